"""The budget report (issue 6): PDF and PNG content, pagination, atomic writes, the CLI and the window.

The poppler checks (``pdfinfo``, ``pdffonts``, ``pdftotext``, ``pdfimages``) are skipped where the tools
are missing; CI installs poppler-utils.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QLocale, QSettings
from PySide6.QtGui import QColor, QImage

from memcalc_gui import __version__
from memcalc_gui.cli import main
from memcalc_gui.core import files as files_module
from memcalc_gui.core.errors import InputError, MemcalcError
from memcalc_gui.core.ledger import shown_objects
from memcalc_gui.core.model import preset_spec
from memcalc_gui.core.result import Result, evaluate
from memcalc_gui.core.setup import TrainingSetup, find_gpu
from memcalc_gui.core.units import format_bytes
from memcalc_gui.core.vocab import OBJECT_LABELS, PHASES
from memcalc_gui.measure.engine import DeviceInfo, MeasureResult, PhaseReading, RankReading
from memcalc_gui.report import ReportWriteError, default_page, export_report, write_report
from memcalc_gui.report.content import SOURCES, build_content, sources_for
from memcalc_gui.ui.settings import SETTINGS_ENV

ROOT = Path(__file__).resolve().parent.parent
POPPLER = all(shutil.which(t) for t in ("pdfinfo", "pdffonts", "pdftotext", "pdfimages"))
needs_poppler = pytest.mark.skipif(not POPPLER, reason="poppler-utils (pdfinfo, pdffonts, pdftotext) not installed")


def setup_on(preset: str, gpu: str | None, **kw) -> TrainingSetup:
    if gpu is None:
        return TrainingSetup(model=preset_spec(preset), **kw)
    g = find_gpu(gpu)
    return TrainingSetup(model=preset_spec(preset), gpu=g.id, capacity_bytes=g.capacity_bytes, **kw)


@pytest.fixture(scope="module")
def over() -> Result:
    """The brief's "does not fit" case: qwen2.5-7b, batch 4, seq 2048, mixed, on an A100 80GB."""
    return evaluate(setup_on("qwen2.5-7b", "a100-80gb", batch=4, seq=2048, precision="mixed"))


@pytest.fixture(scope="module")
def fits() -> Result:
    return evaluate(setup_on("qwen2.5-0.5b", "rtx-4090", batch=4, seq=1024))


@pytest.fixture(scope="module")
def reports(tmp_path_factory, over, fits) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("reports")
    out = {
        "over_a4": export_report(over, folder / "over_a4.pdf", page="a4"),
        "over_letter": export_report(over, folder / "over_letter.pdf", page="letter"),
        "fits_a4": export_report(fits, folder / "fits_a4.pdf", page="a4"),
        "over_png": export_report(over, folder / "over.png"),
        "fits_png": export_report(fits, folder / "fits.png"),
    }
    return out


@pytest.fixture(autouse=True)
def private_settings(tmp_path, monkeypatch):
    monkeypatch.setenv(SETTINGS_ENV, str(tmp_path / "settings"))
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(tmp_path / "qsettings"))
    return tmp_path / "settings"


def tool(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


def pdf_text(path: Path) -> str:
    return tool("pdftotext", "-enc", "UTF-8", str(path), "-")


def flat(text: str) -> str:
    return " ".join(text.split())


# ---- PDF ------------------------------------------------------------------------------------------
@needs_poppler
@pytest.mark.parametrize(("name", "size"), [("over_a4", "595 x 842"), ("over_letter", "612 x 792"),
                                            ("fits_a4", "595 x 842")])
def test_pdf_page_size(reports, name, size):
    info = tool("pdfinfo", str(reports[name]))
    assert re.search(rf"Page size:\s+{size} pts", info), info
    assert int(re.search(r"Pages:\s+(\d+)", info).group(1)) >= 2
    assert f"memcalc {__version__}" in info  # the PDF's creator


@needs_poppler
@pytest.mark.parametrize("name", ["over_a4", "over_letter"])
def test_pdf_fonts_are_embedded(reports, name):
    rows = [line.split() for line in tool("pdffonts", str(reports[name])).splitlines()[2:] if line.strip()]
    assert rows, "no fonts: the text would be a picture"
    for row in rows:
        # columns: name, type (may be two words), encoding, emb, sub, uni, object, ID
        assert row[-5] == "yes", f"font not embedded: {row}"


@needs_poppler
def test_pdf_text_has_the_figures_verdict_and_every_object(reports, over):
    text = pdf_text(reports["over_a4"])
    one = flat(text)
    est, setup = over.estimate, over.setup
    assert format_bytes(est.peak_bytes) in one  # the peak figure
    assert "Does not fit" in one and over.verdict.fits is False
    over_by = format_bytes(-over.verdict.headroom_bytes)
    assert f"Over by {over_by} in the backward phase" in one  # the headline, as the core words it
    assert "Backward (peak)" in one and "Activations (" in one  # peak phase and dominant object
    for obj in shown_objects(est):
        assert OBJECT_LABELS[obj] in text, obj
    assert "Paged optimizer state" not in text  # AdamW: nothing paged, no empty row
    for figure in (f"{setup.num_params:,}", "qwen2", "Qwen/Qwen2.5-7B", "micro-batch", "Largest micro-batch that fits",
                   "none (not even 1)", "1 GiB = 2³⁰ B", __version__):
        assert figure in one, figure
    for s in over.verdict.suggestions:  # in the verdict's one unit
        assert over.size(s.peak_bytes) in one
    assert "Use 8-bit AdamW (bitsandbytes)" in one
    for heading in ("Memory per phase", "Ledger", "Suggestions", "Setup", "Assumptions", "Formulas", "Units",
                    "Sources"):
        assert heading in text
    for source in ("Hugging Face blog", "PyTorch memory notes", "Transformers docs", "memory-profiling guide",
                   "memory ledger", "Korthikanti"):
        assert source in one
    # nothing drawn twice: a line on a page boundary is not also (clipped) at the foot of the previous page
    assert one.count("Each cell: bytes live") == 1
    assert one.count("Changes that fit come first, cheapest for the run first") == 1  # the stated order, once


@needs_poppler
def test_pdf_fits_case(reports, fits):
    one = flat(pdf_text(reports["fits_a4"]))
    assert "Fits" in one and format_bytes(fits.verdict.headroom_bytes) in one
    assert format_bytes(fits.estimate.peak_bytes) in one
    assert str(fits.verdict.max_micro_batch) in one


@needs_poppler
def test_pdf_chart_is_high_resolution_and_lossless(reports):
    rows = [line.split() for line in tool("pdfimages", "-list", str(reports["over_a4"])).splitlines()[2:]]
    assert len(rows) == 1
    row = rows[0]
    x_ppi, y_ppi = int(row[12]), int(row[13])
    assert x_ppi >= 200 and y_ppi >= 200
    assert row[8] != "jpeg"  # the "enc" column: no JPEG artefacts on a chart


def test_tables_repeat_headers_and_rows_are_never_cut(over, tmp_path):
    """Lay out a long report (a 400-module trace) on both papers: every table has a header row, no body row
    crosses a page break, and no heading is left at the foot of a page."""
    from memcalc_gui.report import render
    from memcalc_gui.report.export import ensure_app

    ensure_app()
    modules = [(f"model.layers.{i}.mlp.down_proj", 10_000_000 + 97 * i) for i in range(400)]
    content = build_content(over, modules=modules)
    for page in ("a4", "letter"):
        _layout, rect = render._content_rect_pt(page)
        width = rect.width() * 96 / 72
        height = rect.height() * 96 / 72 - render.FOOTER_PX
        chart = QImage(400, 200, QImage.Format.Format_RGB32)
        doc, _breaks = render.paginate(content, width, height, chart, int(width), int(width * 0.5),
                                       render._layout_device())
        assert doc.pageCount() > 4
        assert render.first_problem(doc, height) is None
        tables = [(rows, h) for rows, h in render.header_rows(doc) if rows > 3]  # not the verdict box's facts
        assert len(tables) >= 7 and all(h == 1 for _rows, h in tables)


@needs_poppler
def test_long_tables_repeat_their_header_on_each_page(over, tmp_path):
    modules = [(f"model.layers.{i}.self_attn.o_proj", 5_000_000 + i) for i in range(120)]
    path = export_report(over, tmp_path / "modules.pdf", page="letter", modules=modules)
    pages = pdf_text(path).split("\f")
    module_pages = [p for p in pages if "self_attn.o_proj" in p]
    assert len(module_pages) >= 2
    for p in module_pages:
        assert "Module" in p and "Share" in p  # the header row on every page the table runs onto
    one = flat("\n".join(pages))
    assert "Per-module breakdown (trace)" in one and "120 modules from the trace" in one


# ---- PNG ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["over_png", "fits_png"])
def test_png_size_and_not_blank(reports, name):
    image = QImage(str(reports[name]))
    assert not image.isNull()
    assert (image.width(), image.height()) == (1600, 1000)
    colors = {image.pixel(x, y) for x in range(0, 1600, 7) for y in range(0, 1000, 7)}
    assert len(colors) > 60  # chart colours, text antialiasing, table fills
    # the verdict banner is tinted red for "does not fit" and green for "fits"
    banner = image.pixelColor(60, 105)
    if name == "over_png":
        assert banner.red() > banner.green()
    else:
        assert banner.green() > banner.red()


# ---- content and sources --------------------------------------------------------------------------
def test_every_assumption_and_formula_names_a_known_source(over):
    quick = evaluate(TrainingSetup(params=1_500_000_000))
    for result in (over, quick):
        content = build_content(result)
        assert content.headline == result.headline()
        for table in (content.assumptions, content.formulas):
            assert table.rows
            for row in table.rows:
                keys = row.cells[1].split("; ")
                assert keys and all(k in SOURCES for k in keys), row
        assert {k for k, _ in content.references} >= {"Hugging Face blog", "Transformers docs", "memory ledger"}
    assert sources_for("Adam: 8 B/param (Transformers docs)")[0] == "Transformers docs"
    assert "Korthikanti 2022" in sources_for("qwen2 block counted tensor by tensor (sdpa attention)")


def test_default_page_follows_the_locale():
    L, T = QLocale.Language, QLocale.Country  # PySide6 names the Territory enum Country
    assert default_page(QLocale(L.English, T.UnitedStates)) == "letter"
    assert default_page(QLocale(L.French, T.Canada)) == "letter"
    assert default_page(QLocale(L.Spanish, T.Mexico)) == "letter"
    assert default_page(QLocale(L.Filipino, T.Philippines)) == "letter"
    assert default_page(QLocale(L.German, T.Germany)) == "a4"
    assert default_page(QLocale(L.English, T.UnitedKingdom)) == "a4"
    assert default_page(QLocale(L.Chinese, T.China)) == "a4"
    assert default_page() in ("a4", "letter")


def fake_measurement(result: Result) -> MeasureResult:
    setup = result.setup
    phases = {p: PhaseReading(peak_bytes=int(result.estimate.phases[p].tensor_bytes * 0.96), live_bytes=0,
                              objects={}, reserved_bytes=0) for p in PHASES}
    return MeasureResult(device=DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 85_000_000_000, 84_000_000_000),
                         setup=setup, requested=setup, scaled=False, scale_note="", phases=phases, estimate=result,
                         iterations_live_bytes=[10 * 2**30, 10 * 2**30, 10 * 2**30], context_bytes=500 * 2**20,
                         peak_reserved_bytes=int(result.estimate.peak_tensor_bytes * 1.05), seconds=4.2)


@needs_poppler
def test_measurement_and_trace_sections(fits, tmp_path):
    measurement = fake_measurement(fits)
    content = build_content(fits, measurement=measurement)
    assert content.measurement is not None and content.measured_peaks
    path = export_report(fits, tmp_path / "measured.pdf", page="a4", measurement=measurement,
                         modules=[("model.embed_tokens", 2**30), ("lm_head", 2**29)])
    one = flat(pdf_text(path))
    assert "Measured vs estimated" in one and "NVIDIA H100 80GB HBM3" in one
    assert "+4.2 %" in one  # (estimate − measured) / measured with a 4 % lower measurement
    for signal in measurement.signals:
        assert flat(signal)[:30] in one
    assert "Per-module breakdown (trace)" in one and "model.embed_tokens" in one and "lm_head" in one
    png = export_report(fits, tmp_path / "measured.png", measurement=measurement)
    assert QImage(str(png)).width() == 1600
    # the PNG prints the measured values and the error beside the ledger, not only diamonds on the chart
    from memcalc_gui.report.render import _png_ledger_html

    html = _png_ledger_html(fits, 15, content.measured_peaks)
    backward = content.measured_peaks["backward"]
    assert "◇ Measured" in html and f"{backward / 2**30:,.2f}" in html and html.count("+4.2 %") == 4


def test_a_multi_rank_measurement_lists_every_rank(fits):
    measurement = fake_measurement(fits)
    est = {p: fits.estimate.phases[p].tensor_bytes for p in PHASES}
    measurement.ranks = [RankReading(r, 2, None, 1, measurement.phases, est, [1, 1]) for r in range(2)]
    measurement.shown_rank = 1
    extra = dict(build_content(fits, measurement=measurement).measurement.extra)
    assert extra["Rank 2 of 2 — shown above"].startswith("forward ")
    assert extra["Rank 1 of 2"].count("+4.2 %") == 3  # forward, backward, optimizer step


# ---- multi-GPU and trace --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def distributed() -> Result:
    """The brief's distributed case: llama-3.1-70b, seq 4096, full checkpointing, 32 GPUs ZeRO-3 on H100s."""
    from memcalc_gui.core.distributed import Parallelism

    return evaluate(setup_on("llama-3.1-70b", "h100-80gb", batch=1, seq=4096, checkpointing="full",
                             parallel=Parallelism(gpus=32, strategy="zero3")))


def test_distributed_content_says_per_gpu_and_has_the_plan(distributed):
    from memcalc_gui.core.distributed import PREFERENCE

    content = build_content(distributed)
    assert content.per_gpu.startswith("32 × NVIDIA H100 80GB HBM3, ZeRO-3")
    assert "per GPU" in content.headline and "per GPU" in content.subtitle
    verdict = dict(content.verdict)
    assert verdict["Peak"].startswith(f"{format_bytes(distributed.estimate.peak_bytes)} per GPU")
    assert verdict["GPU"].startswith("32 × NVIDIA H100")
    setup = dict(content.setup)
    assert setup["Strategy"].startswith("ZeRO-3") and setup["GPUs"].startswith("32")
    assert setup["Offload"] == "none"
    plan = distributed.plan
    assert content.plan is not None and len(content.plan.rows) == len(PREFERENCE)
    best = [r for r in content.plan.rows if r.highlight]
    assert len(best) == 1 and best[0].cells[0].startswith("ZeRO-3") and best[0].cells[1] == str(plan.min_gpus["zero3"])
    assert any("Least communication that fits on 32 GPUs: ZeRO-3" in n for n in content.plan_notes)
    cited = {k for k, _ in content.references}
    assert {"ZeRO 2020", "DeepSpeed", "PyTorch FSDP"} <= cited
    for table in (content.assumptions, content.formulas):
        for row in table.rows:
            assert all(k in SOURCES for k in row.cells[1].split("; ")), row


@needs_poppler
def test_distributed_pdf_and_png_say_per_gpu_strategy_and_host_memory(distributed, tmp_path):
    from memcalc_gui.core.distributed import Parallelism

    one = flat(pdf_text(export_report(distributed, tmp_path / "dist.pdf", page="a4")))
    for text in ("per GPU", "Memory per GPU per phase", "ZeRO-3 (+ parameters sharded)", "GPU plan", "Fewest GPUs",
                 "FSDP FULL_SHARD", "Least communication that fits on 32 GPUs: ZeRO-3", "Rajbhandari"):
        assert text in one, text
    offloaded = evaluate(distributed.setup.with_changes(parallel=Parallelism(gpus=16, strategy="zero3",
                                                                             offload="optimizer")))
    host = format_bytes(offloaded.estimate.details["host_bytes"])
    one = flat(pdf_text(export_report(offloaded, tmp_path / "offload.pdf", page="a4")))
    assert f"{host} per node" in one and "optimizer state offloaded to the CPU" in one
    png = export_report(offloaded, tmp_path / "offload.png")
    assert QImage(str(png)).width() == 1600


@needs_poppler
def test_trace_result_report_lists_modules_and_the_difference(fits, tmp_path):
    import dataclasses

    est = dataclasses.replace(fits.estimate, method="trace")
    traced = Result(est, fits.verdict)
    modules = [("model.layers.*.mlp.gate_proj", 3 * 2**20), ("loss and logits (Qwen2ForCausalLM)", 2**20)]
    path = export_report(traced, tmp_path / "trace.pdf", page="a4", modules=modules,
                         notes=["Trace vs analytic, tensor bytes per phase (traced in 1.0 s): Load +0.0 %"])
    one = flat(pdf_text(path))
    assert "method trace" in one and "Per-module breakdown (trace)" in one
    assert "model.layers.*.mlp.gate_proj" in one and "75.0 %" in one
    assert "Trace vs analytic" in one


# ---- failures -------------------------------------------------------------------------------------
def test_bad_extension_page_and_modules_are_input_errors(over, tmp_path):
    for name in ("report.txt", "report", "report.pdf.bak"):
        with pytest.raises(InputError) as info:
            export_report(over, tmp_path / name)
        assert info.value.field == "out"
    with pytest.raises(InputError) as info:
        export_report(over, tmp_path / "r.pdf", page="a5")
    assert info.value.field == "page"
    with pytest.raises(InputError) as info:
        export_report(over, tmp_path / "r.pdf", modules=[("x", -1)])
    assert info.value.field == "modules"
    assert list(tmp_path.iterdir()) == []


def test_missing_folder_or_a_file_as_folder(over, tmp_path):
    with pytest.raises(ReportWriteError) as info:
        export_report(over, tmp_path / "missing" / "r.pdf")
    assert "missing" in str(info.value) and "does not exist" in info.value.why
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(ReportWriteError):
        export_report(over, blocker / "r.png")
    (tmp_path / "folder.pdf").mkdir()
    with pytest.raises(ReportWriteError) as info:
        export_report(over, tmp_path / "folder.pdf")  # a folder is not a file
    assert isinstance(info.value, MemcalcError) and "folder" in info.value.why
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "folder.pdf"]


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root ignores folder permissions")
def test_unwritable_folder_leaves_nothing(over, tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ReportWriteError) as info:
            export_report(over, folder / "r.pdf")
        assert "permission denied" in str(info.value)
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)


def test_permission_denied_is_reported_with_path_and_reason(over, tmp_path, monkeypatch):
    """What an unwritable folder gives (simulated: as root, folder permissions do not apply)."""
    def denied(*_a, **_k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files_module.tempfile, "mkstemp", denied)
    with pytest.raises(ReportWriteError) as info:
        export_report(over, tmp_path / "r.pdf")
    assert str(tmp_path / "r.pdf") in str(info.value) and info.value.why == "permission denied"
    assert list(tmp_path.iterdir()) == []


def test_disk_full_leaves_no_partial_file_and_keeps_the_old_report(over, tmp_path, monkeypatch):
    target = tmp_path / "report.pdf"
    target.write_bytes(b"the previous report")
    calls = []

    def full_disk(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return os.write(fd, data[: len(data) // 2])  # half of it went out...
        raise OSError(errno.ENOSPC, "No space left on device")  # ...then the disk filled up

    monkeypatch.setattr(files_module, "_write_chunk", full_disk)
    for name in ("report.pdf", "new.png"):
        with pytest.raises(ReportWriteError) as info:
            export_report(over, tmp_path / name, page="a4")
        assert "disk is full" in str(info.value) and name in str(info.value)
        calls.clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.pdf"]  # no temporary or partial file
    assert target.read_bytes() == b"the previous report"


def test_replacing_an_existing_report_keeps_its_permissions(over, tmp_path):
    target = tmp_path / "r.png"
    target.write_bytes(b"old")
    target.chmod(0o640)
    written = write_report(over, target)
    assert written.format == "png" and written.pixels == (1600, 1000) and written.pages == 1
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (target.stat().st_mode & 0o777) == 0o640


# ---- CLI ------------------------------------------------------------------------------------------
def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_report_writes_pdf_and_png(capsys, tmp_path):
    code, out, err = run(capsys, "report", "--preset", "qwen2.5-7b", "--batch", "4", "--seq", "2048",
                         "--precision", "mixed", "--gpu", "a100-80gb", "--out", str(tmp_path / "r.pdf"),
                         "--page", "letter")
    assert code == 0, err
    assert (tmp_path / "r.pdf").read_bytes()[:5] == b"%PDF-"
    assert "Letter" in out and "Does not fit" in out
    code, out, err = run(capsys, "report", "--params", "1.5B", "--out", str(tmp_path / "r.png"))
    assert code == 0, err
    assert QImage(str(tmp_path / "r.png")).size().width() == 1600


@pytest.mark.parametrize(("argv", "flag"), [
    (["--page", "a5"], "--page"),
    (["--out", "{tmp}/r.txt"], "--out"),
    (["--out", "{tmp}/missing/r.pdf"], "--out"),
    (["--batch", "0"], "--batch"),
])
def test_cli_report_errors_are_one_line_exit_2(capsys, tmp_path, argv, flag):
    args = ["report", "--preset", "gpt2", "--out", str(tmp_path / "r.pdf")]
    args += [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, _out, err = run(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memcalc: error:") and flag in lines[0], err
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_cli_report_runs_headless_as_a_command(tmp_path):
    """The real entry point without a display and without QT_QPA_PLATFORM: offscreen by itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    proc = subprocess.run([sys.executable, "-m", "memcalc_gui.cli", "report", "--preset", "gpt2", "--gpu", "t4",
                           "--out", str(tmp_path / "r.pdf"), "--page", "a4"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "A4" in proc.stdout and (tmp_path / "r.pdf").stat().st_size > 10_000


# ---- window ---------------------------------------------------------------------------------------
@pytest.fixture
def window(qtbot):
    from memcalc_gui.ui.main_window import MainWindow

    w = MainWindow()
    qtbot.addWidget(w)
    w.show()
    return w


def test_window_export_action_remembers_the_folder(window, qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QFileDialog

    from memcalc_gui.report import dialog

    assert window.export_action.shortcut().toString() == "Ctrl+E"
    assert window.export_action in window.file_menu.actions()
    asked = []

    def save_as(parent, title, start, filters, selected):
        asked.append((start, selected))
        return str(tmp_path / "out" / "budget"), dialog.FILTERS["png"]  # no extension: the filter decides

    (tmp_path / "out").mkdir()
    monkeypatch.setattr(QFileDialog, "getSaveFileName", staticmethod(save_as))
    window.export_action.trigger()
    written = tmp_path / "out" / "budget.png"
    assert written.is_file() and QImage(str(written)).width() == 1600
    assert window.settings.value(dialog.KEY_LAST_FOLDER) == str(tmp_path / "out")
    assert "Exported the report" in window.statusBar().currentMessage()

    def save_pdf(parent, title, start, filters, selected):
        asked.append((start, selected))
        return str(tmp_path / "out" / "budget.pdf"), dialog.FILTERS["png"]  # the typed extension wins

    monkeypatch.setattr(QFileDialog, "getSaveFileName", staticmethod(save_pdf))
    path = window.export_report()
    assert path == tmp_path / "out" / "budget.pdf" and path.read_bytes()[:5] == b"%PDF-"
    # the second chooser opened in the remembered folder, with the last format
    assert Path(asked[1][0]).parent == tmp_path / "out" and asked[1][1] == dialog.FILTERS["png"]


def test_window_export_error_is_a_message_box_and_nothing_is_lost(window, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QFileDialog, QMessageBox

    shown = []
    monkeypatch.setattr(QMessageBox, "critical", staticmethod(lambda parent, title, text: shown.append(text)))
    monkeypatch.setattr(QFileDialog, "getSaveFileName",
                        staticmethod(lambda *a: (str(tmp_path / "gone" / "r.pdf"), "")))
    assert window.export_report() is None
    assert len(shown) == 1 and "gone" in shown[0] and "does not exist" in shown[0]
    assert list(tmp_path.glob("**/r.pdf")) == []
    # cancelling the chooser does nothing
    monkeypatch.setattr(QFileDialog, "getSaveFileName", staticmethod(lambda *a: ("", "")))
    assert window.export_report() is None and len(shown) == 1


@needs_poppler
def test_a_qlora_report_states_the_tuning_and_the_parameter_split(tmp_path):
    from memcalc_gui.core.finetune import FineTuning

    result = evaluate(setup_on("llama-3.1-8b", "rtx-4090", batch=4, seq=2048, checkpointing="full",
                               tuning=FineTuning(method="qlora")))
    one = flat(pdf_text(export_report(result, tmp_path / "qlora.pdf", page="a4")))
    assert "QLoRA r=16 on all-linear" in one and "41,943,040 trainable parameters" in one
    assert "quantized base" in one and "trainable adapters" in one
    assert "prepare_model_for_kbit_training" in one  # the assumption behind the fp32 embeddings and head
    # the ledger table lists the parameters' parts under the parameters row, as the window does
    assert "↳ quantized base" in one and "↳ trainable adapters" in one and "↳ autocast copies" in one
    png = export_report(result, tmp_path / "qlora.png")
    assert QImage(str(png)).width() == 1600


def _ink_rows(image: QImage, top: int, bottom: int, left: int, right: int) -> list[int]:
    """The rows in [top, bottom) with a dark pixel in [left, right)."""
    return [y for y in range(top, bottom)
            if any(QColor(image.pixel(x, y)).lightness() < 200 for x in range(left, right, 2))]


def test_png_footer_wraps_a_long_setup_line_inside_the_margins(tmp_path):
    """A setup with every parallel dimension spells out more than one line at 1600 px: the footer takes a second
    line rather than running off the right edge, and the chart's title breaks rather than running off the left."""
    from memcalc_gui.core.distributed import Parallelism

    long = evaluate(setup_on("llama-3.1-70b", "h100-80gb", batch=1, seq=8192, checkpointing="full",
                             parallel=Parallelism(gpus=128, strategy="fsdp2", tp=4, sp=True, loss_parallel=True,
                                                  pp=2, cp=2, dp_replicate=2)))
    short = evaluate(setup_on("qwen2.5-0.5b", "h100-80gb", batch=1, seq=1024))
    for result, lines in ((long, 2), (short, 1)):
        image = QImage(str(export_report(result, tmp_path / f"r{lines}.png")))
        w, h = image.width(), image.height()
        footer = _ink_rows(image, h - 50, h, 28, w - 28)
        bands = sum(1 for a, b in zip([-9, *footer], footer, strict=False) if b - a > 1)  # text lines: runs of rows
        assert bands == lines, (result.setup.summary(), footer)
        assert not _ink_rows(image, h - 60, h, w - 26, w), "the footer runs into the right margin"
        assert not _ink_rows(image, 140, 260, 0, 20), "the chart's title runs past the left edge"


def test_one_unit_for_the_verdict_the_ledger_and_the_suggestions():
    """Issue 62: a headroom in MiB stood beside GiB values, and a peak past a TiB on a 24 GiB card put a 20 GiB fix at
    "0.02 TiB". Every size the verdict, the ledger and the suggestions show is in the result's one unit, the
    capacity's (GiB on any GPU), however large the peak."""
    result = evaluate(setup_on("llama-3.1-70b", "rtx-4090", batch=4, seq=2048, grad_accum=4))
    assert result.estimate.peak_bytes > 2**40 and result.unit == "GiB"
    assert any(s.fits for s in result.verdict.suggestions) and not result.verdict.fits
    content = build_content(result)
    assert content.suggestions is not None
    cells = [c for table in (content.ledger, content.suggestions) for row in table.rows for c in row.cells]
    text = " ".join([*cells, *(value for _, value in content.verdict), content.headline])
    assert set(re.findall(r"\d (B|KiB|MiB|GiB|TiB|PiB)\b", text)) == {"GiB"}
    fix = next(s for s in result.verdict.suggestions if s.fits)
    assert result.size(fix.peak_bytes) in text and result.size(fix.peak_bytes).endswith(" GiB")
