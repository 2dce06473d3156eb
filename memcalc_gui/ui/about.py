"""The About dialog: version, licences of bundled parts, sources of the formulas."""

from __future__ import annotations

from PySide6 import __version__ as pyside_version
from PySide6.QtCore import Qt, qVersion
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QTextBrowser, QVBoxLayout, QWidget

from .. import __version__

SOURCES = (
    ("Hugging Face blog, “Visualize and understand GPU memory in PyTorch” (phases, colours, "
     "Total = Model + OptState + max(Grad + OptIntermediates, Activations))",
     "https://huggingface.co/blog/train_memory"),
    ("Hugging Face Transformers documentation, “GPU memory” (6 B/param mixed precision, 8 B/param Adam, "
     "2 B/param 8-bit Adam)", ""),
    ("Zhihu, PyTorch memory article (nn.Linear + AdamW step by step, CUDA context, 512 B rounding)", ""),
    ("DeepHub, memory profiling guide (seven consumers, fragmentation 5–20 %, checkpointing 40–60 %)", ""),
    ("The memory-ledger chapter (objects × lifetimes × phases; peak phase; reconciliation)", ""),
    ("Korthikanti et al. 2022, “Reducing Activation Recomputation in Large Transformer Models”",
     "https://arxiv.org/abs/2205.05198"),
    ("Rajbhandari et al. 2020, “ZeRO: Memory Optimizations Toward Training Trillion Parameter Models”",
     "https://arxiv.org/abs/1910.02054"),
)

LICENCES = (
    ("Qt 6 / PySide6", "LGPL-3.0 (The Qt Company)", "https://www.qt.io/licensing/"),
    ("pyqtgraph", "MIT", "https://github.com/pyqtgraph/pyqtgraph/blob/master/LICENSE.txt"),
    ("NumPy", "BSD-3-Clause", "https://numpy.org/doc/stable/license.html"),
    ("DejaVu fonts (bundled)", "Bitstream Vera licence + public domain changes; see resources/fonts/LICENSE-DejaVu.txt",
     "https://dejavu-fonts.github.io/License.html"),
)


def about_html() -> str:
    def link(text: str, url: str) -> str:
        return f'<a href="{url}">{text}</a>' if url else text

    sources = "".join(f"<li>{link(t, u)}</li>" for t, u in SOURCES)
    licences = "".join(f"<li><b>{name}</b>: {link(lic, url)}</li>" for name, lic, url in LICENCES)
    return (
        f"<h2>memcalc {__version__}</h2>"
        "<p>How much GPU memory one training step needs, phase by phase — and whether it fits.</p>"
        f"<p>memcalc is MIT-licensed. Running on Qt {qVersion()}, PySide6 {pyside_version}.</p>"
        f"<h3>Bundled parts and their licences</h3><ul>{licences}</ul>"
        f"<h3>Where the formulas come from</h3><ul>{sources}</ul>"
    )


class AboutDialog(QDialog):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("About memcalc")
        self.resize(620, 520)
        lay = QVBoxLayout(self)
        header = QLabel(f"memcalc {__version__}")
        header.setObjectName("aboutVersion")
        header.setVisible(False)  # the version is in the text; kept for tests and accessibility
        lay.addWidget(header)
        self.browser = QTextBrowser()
        self.browser.setOpenExternalLinks(True)
        self.browser.setHtml(about_html())
        lay.addWidget(self.browser, 1)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
