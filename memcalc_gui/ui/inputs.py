"""The input panel (left): model, training step, precision & optimizer, GPU.

It only edits a :class:`FormState`; the window turns that into a setup, evaluates it and shows the
errors back here, under the field they belong to.
"""

from __future__ import annotations

import itertools

from PySide6.QtCore import QCoreApplication, QEvent, QModelIndex, QObject, QPersistentModelIndex, QSize, Qt, Signal
from PySide6.QtGui import QKeyEvent, QKeySequence, QPainter, QPalette
from PySide6.QtWidgets import (
    QAbstractScrollArea,
    QCheckBox,
    QComboBox,
    QCompleter,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSizePolicy,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QVBoxLayout,
    QWidget,
)

from ..core.distributed import (
    SCHEDULE_LABELS,
    STRATEGIES,
    STRATEGY_LABELS,
    VIRTUAL_STAGES,
    VOCAB_SPLIT_ALWAYS,
    closest_offload,
    default_loss_parallel,
    offload_choices,
)
from ..core.setup import BNB_OPTIMIZERS, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISION_LABELS, PRECISIONS
from ..view.theme import error_color
from .form import RECIPE_TUNING, RECIPES, FormState, capacity_text, gpu_by_id, recipe_for
from .tooltips import TOOLTIPS

OPTIMIZER_LABELS = {
    "adamw": "AdamW",
    "adam": "Adam",
    "adamw-8bit": "AdamW 8-bit (bitsandbytes)",
    "paged-adamw-8bit": "Paged AdamW 8-bit (bitsandbytes)",
    "paged-adamw-32bit": "Paged AdamW 32-bit (bitsandbytes)",
    "sgd": "SGD",
    "sgd-momentum": "SGD with momentum",
    "adafactor": "Adafactor",
    "lion": "Lion",
    "galore-adamw": "GaLore AdamW (galore-torch)",
    "adamw-bf16-states": "AdamW, bf16 states (AnyPrecisionAdamW)",
}
IMPL_LABELS = {"foreach": "foreach (CUDA default)", "single-tensor": "single-tensor", "fused": "fused"}
ATTENTION_LABELS = {"sdpa": "SDPA (fused kernels)", "eager": "eager (stores L×L scores)",
                    "flash": "FlashAttention-2 (varlen)"}
LOSS_LABELS = {"full": "full logits", "chunked": "chunked (Liger)"}
ACTIVATION_OFFLOAD_LABELS = {"none": "none", "checkpoint-inputs": "checkpoint inputs (torchtune)",
                             "all": "every saved tensor (save_on_cpu)"}
PRECISION_SHORT = {"fp32": "fp32", "mixed": "Mixed (fp32 master + 16-bit)", "bf16": "bf16 (pure 16-bit)",
                   "bf16-autocast": "bf16 + autocast"}
MODEL_KIND_LABELS = {"preset": "Preset", "config": "config.json", "hub": "Hugging Face Hub id",
                     "params": "Parameter count only"}
CUSTOM_RECIPE = "custom"
OFFLOAD_LABELS = {
    "none": "None",
    "optimizer": "Optimizer state → CPU (ZeRO-Offload)",
    "params": "Parameters → CPU (+ optimizer state)",
    "both": "Optimizer state and parameters → CPU",
}
#: FSDP has one CPUOffload: parameters, gradients and the optimizer step move together.
FSDP_OFFLOAD_LABEL = "CPUOffload: parameters, gradients, step → CPU"


def offload_labels(strategy: str) -> dict[str, str]:
    """The offload choices that differ for ``strategy`` (core.distributed.offload_choices), labelled."""
    return {k: FSDP_OFFLOAD_LABEL if k == "both" and strategy.startswith("fsdp") else OFFLOAD_LABELS[k]
            for k in offload_choices(strategy)}
TUNING_LABELS = {"full": "All (full fine-tuning)", "lora": "LoRA adapters (peft)",
                 "qlora": "QLoRA: adapters on a 4-bit base", "frozen": "Some parts (the rest frozen)"}
QUANT_LABELS = {"nf4": "NF4 (4-bit, QLoRA)", "fp4": "FP4 (4-bit)", "int8": "int8 (LLM.int8)"}
#: Strategies whose node size matters without offload (HYBRID_SHARD shards within a node).
NODE_SIZE_STRATEGIES = ("fsdp-hybrid",)


class _KeepUndoForWindow(QObject):
    """Lets Ctrl+Z / Ctrl+Shift+Z reach the window's undo stack instead of a line edit's own undo."""

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.ShortcutOverride and isinstance(event, QKeyEvent) and (
            event.matches(QKeySequence.StandardKey.Undo) or event.matches(QKeySequence.StandardKey.Redo)
        ):
            event.ignore()
            return True
        return False


class _ScrollNotChoose(QObject):
    """The mouse wheel over a choice that does not have the keyboard focus scrolls the form, as the pointer passes
    over it while scrolling, instead of changing the choice (the Qt default, which changed settings unseen)."""

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if event.type() != QEvent.Type.Wheel or not isinstance(obj, QWidget) or obj.hasFocus():
            return False
        parent = obj.parentWidget()
        while parent is not None and not isinstance(parent, QAbstractScrollArea):
            parent = parent.parentWidget()
        if parent is not None:
            QCoreApplication.sendEvent(parent.verticalScrollBar(), event)
        return True


class IntEdit(QLineEdit):
    """A positive-integer line edit: Up/Down step by 1, PgUp/PgDn double/halve. Invalid text is allowed
    (the window reports it inline)."""

    def keyPressEvent(self, event: QKeyEvent) -> None:
        key = event.key()
        steps = {Qt.Key.Key_Up: lambda v: v + 1, Qt.Key.Key_Down: lambda v: max(1, v - 1),
                 Qt.Key.Key_PageUp: lambda v: v * 2, Qt.Key.Key_PageDown: lambda v: max(1, v // 2)}
        if key in steps:
            try:
                value = int(self.text().strip())
            except ValueError:
                value = 0
            if value >= 1:
                self.setText(str(steps[key](value)))
                event.accept()
                return
        super().keyPressEvent(event)


class FieldBox(QWidget):
    """A field with its inline error message underneath (hidden while valid)."""

    def __init__(self, field: QWidget, extra: QWidget | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.field = field
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        if extra is None:
            lay.addWidget(field)
        else:
            row = QHBoxLayout()
            row.setContentsMargins(0, 0, 0, 0)
            row.setSpacing(6)
            row.addWidget(field, 1)
            row.addWidget(extra)
            lay.addLayout(row)
        self.error = QLabel(self)
        self.error.setWordWrap(True)
        self.error.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.error.setVisible(False)
        self.error.setObjectName("fieldError")
        lay.addWidget(self.error)
        self._message = ""

    def set_error(self, message: str | None) -> None:
        message = message or ""
        if message == self._message:
            return
        self._message = message
        self.error.setText(message)
        self.error.setVisible(bool(message))
        self.field.setProperty("invalid", bool(message))
        self.field.setAccessibleDescription(message)
        style = self.field.style()
        style.unpolish(self.field)
        style.polish(self.field)
        self._color()

    def message(self) -> str:
        return self._message

    def _color(self) -> None:
        pal = self.error.palette()
        pal.setColor(QPalette.ColorRole.WindowText, error_color(self.palette()))
        self.error.setPalette(pal)


class PageStack(QWidget):
    """Pages shown one at a time (the model's sources), as tall as the page on show.

    ``QStackedWidget`` is as tall as the tallest height-for-width of all its pages, hidden ones included: Qt's
    ``QStackedLayout.heightForWidth`` asks every page, whatever its size policy. With the Hub id's error line on screen,
    the hidden config page (106 px at the form's width, measured) made the Hub row 14 px taller than its own page
    (92 px), and the field sat below its label. Here the other pages are hidden in a box layout, which leaves them
    out of every size."""

    def __init__(self) -> None:
        super().__init__()
        self._box = QVBoxLayout(self)
        self._box.setContentsMargins(0, 0, 0, 0)
        self._box.setSpacing(0)
        self._pages: list[QWidget] = []
        self._current = 0

    def addWidget(self, page: QWidget) -> None:  # QStackedWidget's names, so that it can stand in for one
        self._box.addWidget(page)
        self._pages.append(page)
        page.setVisible(len(self._pages) - 1 == self._current)

    def count(self) -> int:
        return len(self._pages)

    def widget(self, index: int) -> QWidget:
        return self._pages[index]

    def currentIndex(self) -> int:
        return self._current

    def currentWidget(self) -> QWidget:
        return self._pages[self._current]

    def setCurrentIndex(self, index: int) -> None:
        if not 0 <= index < len(self._pages):
            raise IndexError(f"page {index} of {len(self._pages)}")
        self._current = index
        for i, page in enumerate(self._pages):  # hide first, then show: the new page never shares the row
            if i != index:
                page.setVisible(False)
        self._pages[index].setVisible(True)


def _combo(items: dict[str, str], tooltip: str) -> QComboBox:
    combo = QComboBox()
    for value, label in items.items():
        combo.addItem(label, value)
    combo.setToolTip(tooltip)
    combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
    combo.setMinimumContentsLength(12)
    return combo


def _set_combo(combo: QComboBox, value: str, fallback: str | None = None) -> None:
    i = combo.findData(value)
    if i < 0 and fallback is not None:
        i = combo.findData(fallback)
    if i >= 0:
        combo.setCurrentIndex(i)


class PresetDelegate(QStyledItemDelegate):
    """Draws a preset's size and family right-aligned and muted beside its name (``1.54B · qwen2``), in the
    drop-down list and in the completion popup (looked up by the shown name, so both models work)."""

    def __init__(self, details: dict[str, str], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.details = details

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex
              ) -> None:
        super().paint(painter, option, index)
        detail = self.details.get(str(index.data(Qt.ItemDataRole.DisplayRole) or ""))
        if not detail:
            return
        painter.save()
        selected = bool(option.state & QStyle.StateFlag.State_Selected)  # type: ignore[attr-defined]
        role = QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.PlaceholderText
        painter.setPen(option.palette.color(role))  # type: ignore[attr-defined]
        rect = option.rect.adjusted(0, 0, -8, 0)  # type: ignore[attr-defined]
        painter.drawText(rect, int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter), detail)
        painter.restore()

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex) -> QSize:
        size = super().sizeHint(option, index)
        detail = self.details.get(str(index.data(Qt.ItemDataRole.DisplayRole) or ""))
        if detail:
            size.setWidth(size.width() + option.fontMetrics.horizontalAdvance(detail) + 24)  # type: ignore[attr-defined]
        return size


class InputPanel(QWidget):
    """All inputs. ``edited`` fires on every user change; ``open_config_requested`` on the button."""

    edited = Signal()
    open_config_requested = Signal()
    fetch_hub_requested = Signal(str)
    layouts_requested = Signal()

    def __init__(self, preset_names: list[str], parent: QWidget | None = None, *,
                 preset_details: dict[str, str] | None = None, preset_groups: list[list[str]] | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("inputPanel")
        self._undo_filter = _KeepUndoForWindow(self)
        self._updating = False
        #: the vocabulary-split box as the user left it: "auto" (the strategy's default) until clicked
        self._loss_parallel_choice = "auto"
        self.boxes: dict[str, FieldBox] = {}
        self.labels: dict[str, QLabel] = {}
        outer = QVBoxLayout(self)
        outer.setContentsMargins(8, 8, 8, 8)
        outer.setSpacing(10)

        # ---- model ----
        model_group = QGroupBox("Model")
        mform = self._form(model_group)
        self.model_kind = _combo(MODEL_KIND_LABELS, TOOLTIPS["model_kind"])
        self._row(mform, "&Source:", "model_kind", self.model_kind)
        self.model_stack = PageStack()
        self.model_stack.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)

        self.preset = QComboBox()
        self.preset.setEditable(True)
        self.preset.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        # the list groups the presets by family (a separator between families, each smallest first); typing
        # filters them all by any part of the name
        for i, group in enumerate(preset_groups or [preset_names]):
            if i:
                self.preset.insertSeparator(self.preset.count())
            self.preset.addItems(group)
        self.preset.setMaxVisibleItems(20)
        self.preset.setToolTip(TOOLTIPS["preset"])
        completer = QCompleter(preset_names, self.preset)
        completer.setCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        completer.setFilterMode(Qt.MatchFlag.MatchContains)
        completer.setCompletionMode(QCompleter.CompletionMode.PopupCompletion)
        self.preset.setCompleter(completer)
        self.preset.lineEdit().setPlaceholderText("type to filter, e.g. qwen")
        self.preset.lineEdit().setClearButtonEnabled(True)
        self.preset_delegate = PresetDelegate(preset_details or {}, self.preset)
        self.preset.setItemDelegate(self.preset_delegate)
        completer.popup().setItemDelegate(self.preset_delegate)
        self.preset.view().setMinimumWidth(self.preset.view().sizeHintForColumn(0) + 24)

        self.config_path = QLineEdit()
        self.config_path.setPlaceholderText("path to config.json")
        self.config_path.setToolTip(TOOLTIPS["config_path"])
        self.open_button = QPushButton("&Open config.json…")
        self.open_button.setToolTip("Open a Hugging Face config.json (Ctrl+O). You can also drop one on the window.")
        self.open_button.clicked.connect(self.open_config_requested)
        config_page = self._field_page("config_path", self.config_path, self.open_button)

        self.hub_id = QLineEdit()
        self.hub_id.setPlaceholderText("org/name, e.g. meta-llama/Llama-3.1-8B")
        self.hub_id.setToolTip(TOOLTIPS["hub_id"])
        self.fetch_button = QPushButton("&Fetch from the Hub")
        self.fetch_button.setToolTip("Download this model's config.json (only the config) from the Hugging Face Hub. "
                                     "A model already in the local Hugging Face cache needs no fetch.")
        self.fetch_button.clicked.connect(lambda: self.fetch_hub_requested.emit(self.hub_id.text().strip()))
        hub_page = self._field_page("hub_id", self.hub_id, self.fetch_button)

        self.params = QLineEdit()
        self.params.setPlaceholderText("1.5B, 350M or 1.5e9")
        self.params.setToolTip(TOOLTIPS["params"])

        self.boxes["preset"] = FieldBox(self.preset)
        self.boxes["params"] = FieldBox(self.params)
        self.model_stack.addWidget(self.boxes["preset"])
        self.model_stack.addWidget(config_page)
        self.model_stack.addWidget(hub_page)
        self.model_stack.addWidget(self.boxes["params"])
        self.model_label = QLabel("&Preset:")
        self.model_label.setBuddy(self.preset)
        mform.addRow(self.model_label, self.model_stack)
        self.model_info = QLabel("")
        self.model_info.setWordWrap(True)
        self.model_info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.model_info.setObjectName("modelInfo")
        self.model_info.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        mform.addRow(self.model_info)
        outer.addWidget(model_group)

        # ---- training step ----
        step_group = QGroupBox("Training step")
        sform = self._form(step_group)
        self.batch = IntEdit()
        self._row(sform, "&Micro-batch:", "batch", self.batch)
        self.seq = IntEdit()
        self._row(sform, "Se&quence length:", "seq", self.seq)
        self.grad_accum = IntEdit()
        self._row(sform, "&Gradient accumulation:", "grad_accum", self.grad_accum)
        self.effective = QLabel("")
        self.effective.setObjectName("effectiveBatch")
        self.effective.setWordWrap(True)
        self.effective.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.effective.setToolTip("Sequences per optimizer step = micro-batch × gradient accumulation.")
        sform.addRow("Effective batch:", self.effective)
        self.packing = QCheckBox("Pack documents (padding-free)")
        self.packing.setObjectName("packing")
        self.packing.setToolTip(TOOLTIPS["packing"])
        self.boxes["packing"] = FieldBox(self.packing)
        sform.addRow(self.boxes["packing"])
        self.tokens_per_batch = IntEdit()
        self.tokens_per_batch.setObjectName("tokensPerBatch")
        self.tokens_per_batch.setPlaceholderText("micro-batch × sequence")
        self.tokens_per_batch.setToolTip(TOOLTIPS["tokens_per_batch"])
        self._row(sform, "Real tokens per micro-batch:", "tokens_per_batch", self.tokens_per_batch)
        self.checkpointing = QCheckBox("Gradient &checkpointing")
        self.checkpointing.setToolTip(TOOLTIPS["checkpointing"])
        self.boxes["checkpointing"] = FieldBox(self.checkpointing)
        sform.addRow(self.boxes["checkpointing"])
        self.ckpt_every = IntEdit()
        self.ckpt_every.setObjectName("checkpointEvery")
        self.ckpt_every.setPlaceholderText("every layer")
        self.ckpt_every.setToolTip(TOOLTIPS["ckpt_every"])
        self._row(sform, "Checkpoint every N-th:", "ckpt_every", self.ckpt_every)
        self.ckpt_selective = QCheckBox("Keep matmul and attention outputs (per op)")
        self.ckpt_selective.setObjectName("checkpointSelective")
        self.ckpt_selective.setToolTip(TOOLTIPS["ckpt_selective"])
        self.boxes["ckpt_selective"] = FieldBox(self.ckpt_selective)
        sform.addRow(self.boxes["ckpt_selective"])
        self.use_cache = QCheckBox("&Keep use_cache (k/v cache in forward)")
        self.use_cache.setObjectName("useCache")
        self.use_cache.setToolTip(TOOLTIPS["use_cache"])
        self.boxes["use_cache"] = FieldBox(self.use_cache)
        sform.addRow(self.boxes["use_cache"])
        self.attention = _combo(ATTENTION_LABELS, TOOLTIPS["attention"])
        self._row(sform, "A&ttention:", "attention", self.attention)
        self.activation_offload = _combo(ACTIVATION_OFFLOAD_LABELS, TOOLTIPS["activation_offload"])
        self.activation_offload.setObjectName("activationOffload")
        self._row(sform, "Offload activations:", "activation_offload", self.activation_offload)
        self.loss = _combo(LOSS_LABELS, TOOLTIPS["loss"])
        self._row(sform, "Loss:", "loss", self.loss)
        self.loss_chunk = IntEdit()
        self.loss_chunk.setPlaceholderText("auto (Liger's rule)")
        self._row(sform, "Loss chunk (tokens):", "loss_chunk", self.loss_chunk)
        outer.addWidget(step_group)

        # ---- fine-tuning ----
        tune_group = QGroupBox("Fine-tuning")
        tform = self._form(tune_group)
        self.tuning = _combo(TUNING_LABELS, TOOLTIPS["tuning"])
        self._row(tform, "&Weights trained:", "tuning", self.tuning)
        self.lora_rank = IntEdit()
        self.lora_rank.setPlaceholderText("16")
        self._row(tform, "LoRA rank:", "lora_rank", self.lora_rank)
        self.lora_targets = QComboBox()
        self.lora_targets.setEditable(True)
        self.lora_targets.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.lora_targets.addItems(["all-linear", "attention", "mlp", "q_proj,v_proj", "q,k,v,o"])
        self.lora_targets.setToolTip(TOOLTIPS["lora_targets"])
        self._row(tform, "Target modules:", "lora_targets", self.lora_targets)
        self.lora_dropout = QLineEdit()
        self.lora_dropout.setPlaceholderText("0.05")
        self._row(tform, "LoRA dropout:", "lora_dropout", self.lora_dropout)
        self.quant = _combo(QUANT_LABELS, TOOLTIPS["quant"])
        self._row(tform, "Base quantization:", "quant", self.quant)
        self.double_quant = QCheckBox("Double quantization (QLoRA)")
        self.double_quant.setToolTip(TOOLTIPS["double_quant"])
        self.boxes["double_quant"] = FieldBox(self.double_quant)
        tform.addRow(self.boxes["double_quant"])
        self.prepare_kbit = QCheckBox("Cast the rest to fp32 (prepare_model_for_kbit_training)")
        self.prepare_kbit.setToolTip(TOOLTIPS["prepare_kbit"])
        self.boxes["prepare_kbit"] = FieldBox(self.prepare_kbit)
        tform.addRow(self.boxes["prepare_kbit"])
        self.trainable = QLineEdit()
        self.trainable.setPlaceholderText("last:4, norms, lm_head, embeddings")
        self._row(tform, "Trainable parts:", "trainable", self.trainable)
        self.trainable_info = QLabel("")
        self.trainable_info.setObjectName("trainableInfo")
        self.trainable_info.setWordWrap(True)
        self.trainable_info.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        tform.addRow(self.trainable_info)
        outer.addWidget(tune_group)

        # ---- precision & optimizer ----
        prec_group = QGroupBox("Precision && optimizer")
        pform = self._form(prec_group)
        recipes = {key: label for key, label, _p, _o in RECIPES}
        recipes[CUSTOM_RECIPE] = "Custom"
        self.recipe = _combo(recipes, TOOLTIPS["recipe"])
        self._row(pform, "P&reset:", "recipe", self.recipe)
        self.precision = _combo({p: PRECISION_SHORT.get(p, p) for p in PRECISIONS}, TOOLTIPS["precision"])
        for i in range(self.precision.count()):
            self.precision.setItemData(i, PRECISION_LABELS.get(self.precision.itemData(i), ""),
                                       Qt.ItemDataRole.ToolTipRole)
        self._row(pform, "Precision:", "precision", self.precision)
        self.optimizer = _combo({o: OPTIMIZER_LABELS.get(o, o) for o in OPTIMIZERS}, TOOLTIPS["optimizer"])
        self._row(pform, "Optimi&zer:", "optimizer", self.optimizer)
        self.optimizer_impl = _combo({i: IMPL_LABELS.get(i, i) for i in OPTIMIZER_IMPLS}, TOOLTIPS["optimizer_impl"])
        self._row(pform, "&Implementation:", "optimizer_impl", self.optimizer_impl)
        self.galore_rank = IntEdit()
        self.galore_rank.setObjectName("galoreRank")
        self.galore_rank.setToolTip(TOOLTIPS["galore_rank"])
        self._row(pform, "GaLore rank:", "galore_rank", self.galore_rank)
        self.optimizer_in_backward = QCheckBox("Step in backward (gradients freed as made)")
        self.optimizer_in_backward.setToolTip(TOOLTIPS["optimizer_in_backward"])
        self.boxes["optimizer_in_backward"] = FieldBox(self.optimizer_in_backward)
        pform.addRow(self.boxes["optimizer_in_backward"])
        outer.addWidget(prec_group)

        # ---- GPU ----
        gpu_group = QGroupBox("GPU")
        gform = self._form(gpu_group)
        self.gpu = QComboBox()
        for g in gpu_by_id().values():
            self.gpu.addItem(f"{g.name} ({g.nominal})", g.id)
        self.gpu.addItem("Custom capacity", "")
        self.gpu.setToolTip(TOOLTIPS["gpu"])
        self.gpu.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.gpu.setMinimumContentsLength(12)
        self._row(gform, "GP&U:", "gpu", self.gpu)
        self.capacity = QLineEdit()
        self.capacity.setPlaceholderText("e.g. 80GiB, 24GB (empty: no verdict)")
        self.capacity.setToolTip(TOOLTIPS["capacity"])
        self._row(gform, "Capacit&y:", "capacity", self.capacity)
        self.gpus = IntEdit()
        self.gpus.setPlaceholderText("1")
        self._row(gform, "Num&ber of GPUs:", "gpus", self.gpus)
        # the model-parallel dimensions, compactly: tensor parallel [n] ☐ sequence parallel; pipeline [n] schedule [v]
        self.tp = IntEdit()
        self.tp.setPlaceholderText("1")
        self.sp = QCheckBox("Sequence parallel")
        self.sp.setObjectName("sequenceParallel")
        self.sp.setToolTip(TOOLTIPS["sp"])
        self._row(gform, "Tensor parallel:", "tp", self.tp, extra=self.sp)
        self.loss_parallel = QCheckBox("Split the vocabulary too (loss parallel)")
        self.loss_parallel.setObjectName("lossParallel")
        self.loss_parallel.setToolTip(TOOLTIPS["loss_parallel"])
        self.boxes["loss_parallel"] = FieldBox(self.loss_parallel)
        gform.addRow(self.boxes["loss_parallel"])
        self.cp = IntEdit()
        self.cp.setPlaceholderText("1")
        self._row(gform, "Context parallel:", "cp", self.cp)
        self.pp = IntEdit()
        self.pp.setPlaceholderText("1")
        self.schedule = _combo(SCHEDULE_LABELS, TOOLTIPS["schedule"])
        self.virtual_stages = IntEdit()
        self.virtual_stages.setObjectName("virtualStages")
        self.virtual_stages.setPlaceholderText("2")
        self.virtual_stages.setToolTip(TOOLTIPS["virtual_stages"])
        self.virtual_stages.setMaximumWidth(48)
        pipe_extra = QWidget()
        pipe_row = QHBoxLayout(pipe_extra)
        pipe_row.setContentsMargins(0, 0, 0, 0)
        pipe_row.setSpacing(4)
        pipe_row.addWidget(self.schedule, 1)
        pipe_row.addWidget(self.virtual_stages)
        self._row(gform, "Pipeline stages:", "pp", self.pp, extra=pipe_extra)
        self.strategy = _combo({k: STRATEGY_LABELS.get(k, k) for k in STRATEGIES}, TOOLTIPS["strategy"])
        self._row(gform, "Str&ategy:", "strategy", self.strategy)
        self.reshard_after_forward = QCheckBox("Reshard after forward (FSDP2)")
        self.reshard_after_forward.setObjectName("reshardAfterForward")
        self.reshard_after_forward.setToolTip(TOOLTIPS["reshard_after_forward"])
        self.reshard_after_forward.setChecked(True)
        self.boxes["reshard_after_forward"] = FieldBox(self.reshard_after_forward)
        gform.addRow(self.boxes["reshard_after_forward"])
        self.dp_replicate = IntEdit()
        self.dp_replicate.setObjectName("dpReplicate")
        self.dp_replicate.setPlaceholderText("1")
        self.dp_replicate.setToolTip(TOOLTIPS["dp_replicate"])
        self._row(gform, "FSDP2 replicas:", "dp_replicate", self.dp_replicate)
        self.node_size = IntEdit()
        self.node_size.setPlaceholderText("8")
        self._row(gform, "GPUs per &node:", "node_size", self.node_size)
        self.ep = IntEdit()
        self.ep.setPlaceholderText("1")
        self._row(gform, "Experts split over:", "ep", self.ep)
        self.etp = IntEdit()
        self.etp.setObjectName("etp")
        self.etp.setPlaceholderText("1")
        self._row(gform, "Each expert split over:", "etp", self.etp)
        self.offload = _combo(offload_labels("ddp"), TOOLTIPS["offload"])
        self._row(gform, "Offloa&d:", "offload", self.offload)
        self.cuda_context = QLineEdit()
        self.cuda_context.setPlaceholderText("e.g. 512 MiB")
        self.cuda_context.setToolTip(TOOLTIPS["cuda_context"])
        self._row(gform, "CUDA conte&xt:", "cuda_context", self.cuda_context)
        self.allocator_reserve = QLineEdit()
        self.allocator_reserve.setPlaceholderText("e.g. 10 %")
        self.allocator_reserve.setToolTip(TOOLTIPS["allocator_reserve"])
        self._row(gform, "Allocator reserve:", "allocator_reserve", self.allocator_reserve)
        self.layouts_button = QPushButton("Find lay&outs…")
        self.layouts_button.setObjectName("findLayouts")
        self.layouts_button.setToolTip("Every tensor × pipeline × data-parallel split of these GPUs, the most loaded "
                                       "GPU's memory and whether it fits, best first (the same search as "
                                       "`memcalc layouts`)")
        self.layouts_button.clicked.connect(self.layouts_requested)
        gform.addRow(self.layouts_button)
        outer.addWidget(gpu_group)

        # ---- a general message (errors that belong to no single field) ----
        self.boxes["general"] = FieldBox(QWidget())
        outer.addWidget(self.boxes["general"])
        outer.addStretch(1)

        for edit in (self.preset.lineEdit(), self.config_path, self.hub_id, self.params, self.batch, self.seq,
                     self.grad_accum, self.capacity, self.gpus, self.tp, self.cp, self.pp, self.virtual_stages,
                     self.node_size, self.dp_replicate,
                     self.ep, self.etp, self.cuda_context, self.allocator_reserve):
            edit.installEventFilter(self._undo_filter)
        self._scroll_filter = _ScrollNotChoose(self)
        for combo in self.findChildren(QComboBox):
            combo.setFocusPolicy(Qt.FocusPolicy.StrongFocus)  # a wheel does not take the focus either
            combo.installEventFilter(self._scroll_filter)
        self._connect()
        self._tab_order()
        self.setStyleSheet("*[invalid=\"true\"] { border: 1px solid #D32F2F; border-radius: 3px; }")

    # ---- construction helpers -----------------------------------------------------------------
    @staticmethod
    def _form(group: QGroupBox) -> QFormLayout:
        form = QFormLayout(group)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        form.setLabelAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        form.setContentsMargins(8, 8, 8, 8)
        form.setVerticalSpacing(6)
        return form

    def _row(self, form: QFormLayout, label: str, name: str, widget: QWidget, extra: QWidget | None = None) -> None:
        if not widget.toolTip() and name in TOOLTIPS:
            widget.setToolTip(TOOLTIPS[name])
        box = FieldBox(widget, extra)
        self.boxes[name] = box
        lab = QLabel(label)
        lab.setBuddy(widget)
        lab.setToolTip(widget.toolTip())
        self.labels[name] = lab
        form.addRow(lab, box)

    def _connect(self) -> None:
        self.model_kind.currentIndexChanged.connect(self._on_kind)
        self.preset.currentTextChanged.connect(self._changed)
        for edit in (self.config_path, self.hub_id, self.params, self.batch, self.seq, self.grad_accum,
                     self.cuda_context, self.allocator_reserve, self.gpus, self.node_size, self.ep, self.etp,
                     self.virtual_stages, self.cp, self.dp_replicate):
            edit.textChanged.connect(self._changed)
        for edit in (self.tp, self.pp):
            edit.textChanged.connect(self._on_model_parallel)
        self.schedule.currentIndexChanged.connect(self._on_model_parallel)
        self.sp.toggled.connect(self._changed)
        self.loss_parallel.clicked.connect(self._on_loss_parallel)
        self.capacity.textChanged.connect(self._on_capacity)
        self.checkpointing.toggled.connect(self._on_checkpointing)
        self.ckpt_every.textChanged.connect(self._changed)
        self.ckpt_selective.toggled.connect(self._on_checkpointing)
        self.use_cache.toggled.connect(self._changed)
        self.optimizer_in_backward.toggled.connect(self._changed)
        self.reshard_after_forward.toggled.connect(self._changed)
        for edit in (self.lora_rank, self.lora_dropout, self.trainable):
            edit.textChanged.connect(self._changed)
        self.lora_targets.currentTextChanged.connect(self._changed)
        self.quant.currentIndexChanged.connect(self._changed)
        self.double_quant.toggled.connect(self._changed)
        self.prepare_kbit.toggled.connect(self._changed)
        self.tuning.currentIndexChanged.connect(self._on_tuning)
        for combo in (self.attention, self.optimizer_impl):
            combo.currentIndexChanged.connect(self._changed)
        self.loss.currentIndexChanged.connect(self._on_loss)
        self.activation_offload.currentIndexChanged.connect(self._changed)
        self.loss_chunk.textChanged.connect(self._changed)
        self.packing.toggled.connect(self._on_packing)
        self.tokens_per_batch.textChanged.connect(self._changed)
        self.galore_rank.textChanged.connect(self._changed)
        for combo in (self.strategy, self.offload):
            combo.currentIndexChanged.connect(self._on_parallel)
        self.precision.currentIndexChanged.connect(self._on_precision_or_optimizer)
        self.optimizer.currentIndexChanged.connect(self._on_precision_or_optimizer)
        self.recipe.currentIndexChanged.connect(self._on_recipe)
        self.gpu.currentIndexChanged.connect(self._on_gpu)
        self.preset.lineEdit().returnPressed.connect(self._accept_unique_preset)

    def _accept_unique_preset(self) -> None:
        """Enter on text that names one preset (a prefix or any part of it) completes it and closes the popup."""
        text = self.preset.currentText().strip().lower()
        names = [self.preset.itemText(i) for i in range(self.preset.count())]
        matches = [n for n in names if text and text in n]
        if text not in names and len(matches) == 1:
            self.preset.setCurrentText(matches[0])
        completer = self.preset.completer()
        if completer is not None:
            completer.popup().hide()

    def _tab_order(self) -> None:
        chain = [self.model_kind, self.preset, self.config_path, self.open_button, self.hub_id, self.fetch_button,
                 self.params, self.batch, self.seq, self.grad_accum, self.packing, self.tokens_per_batch,
                 self.checkpointing, self.use_cache,
                 self.ckpt_every, self.ckpt_selective, self.attention, self.activation_offload, self.loss,
                 self.loss_chunk, self.tuning,
                 self.lora_rank, self.lora_targets, self.lora_dropout, self.quant, self.double_quant, self.prepare_kbit,
                 self.trainable, self.recipe,
                 self.precision,
                 self.optimizer, self.optimizer_impl, self.galore_rank, self.optimizer_in_backward, self.gpu,
                 self.capacity, self.gpus, self.tp, self.sp, self.loss_parallel, self.cp, self.pp, self.schedule,
                 self.virtual_stages,
                 self.strategy, self.reshard_after_forward, self.dp_replicate, self.node_size,
                 self.ep, self.etp, self.offload, self.cuda_context, self.allocator_reserve, self.layouts_button]
        for a, b in itertools.pairwise(chain):
            QWidget.setTabOrder(a, b)

    @property
    def first_widget(self) -> QWidget:
        return self.model_kind

    @property
    def last_widget(self) -> QWidget:
        return self.allocator_reserve

    # ---- reactions ----------------------------------------------------------------------------
    def _changed(self, *_: object) -> None:
        if not self._updating:
            self.edited.emit()

    def _field_page(self, name: str, field: QWidget, button: QPushButton) -> QWidget:
        """A model-source page: the field (with its error line) over a left-aligned button."""
        page = QWidget()
        layout = QVBoxLayout(page)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        self.boxes[name] = FieldBox(field)
        layout.addWidget(self.boxes[name])
        layout.addWidget(button, 0, Qt.AlignmentFlag.AlignLeft)
        return page

    def _on_kind(self, *_: object) -> None:
        self._sync_kind()
        self._changed()

    def _sync_kind(self) -> None:
        kind = self.model_kind.currentData()
        index = {"preset": 0, "config": 1, "hub": 2, "params": 3}.get(kind, 0)
        self.model_stack.setCurrentIndex(index)  # as tall as this page (PageStack)
        pages = {0: ("&Preset:", self.preset), 1: ("&JSON file:", self.config_path), 2: ("&Hub id:", self.hub_id),
                 3: ("&Parameters:", self.params)}
        label, buddy = pages[index]
        self.model_label.setText(label)
        self.model_label.setBuddy(buddy)

    def _on_capacity(self, *_: object) -> None:
        if self._updating:
            return
        gpu = gpu_by_id().get(self.gpu.currentData() or "")
        if gpu is not None and self.capacity.text().strip() != capacity_text(gpu):
            self._updating = True
            try:
                _set_combo(self.gpu, "")
            finally:
                self._updating = False
        self._changed()

    def _on_gpu(self, *_: object) -> None:
        if self._updating:
            return
        gpu = gpu_by_id().get(self.gpu.currentData() or "")
        if gpu is not None:
            self._updating = True
            try:
                self.capacity.setText(capacity_text(gpu))
            finally:
                self._updating = False
        self._changed()

    def _on_parallel(self, *_: object) -> None:
        if self.sender() is self.strategy:
            self._sync_offload()
        self._sync_node_size()
        self._sync_reshard()
        self._sync_loss_parallel()
        self._changed()

    def _on_loss_parallel(self, checked: bool) -> None:
        """A click on the vocabulary-split box is the user's choice, kept across strategies (but Megatron-LM's)."""
        self._loss_parallel_choice = "true" if checked else "false"
        self._changed()

    def _on_model_parallel(self, *_: object) -> None:
        self._sync_model_parallel()
        self._changed()

    def _sync_model_parallel(self) -> None:
        """Sequence parallelism needs tensor parallelism, a schedule needs stages, stages per GPU the interleaved
        schedule: each control is live only where it applies (its choice is kept)."""
        def number(edit: QLineEdit) -> int:
            text = edit.text().strip()
            return int(text) if text.isdigit() and len(text) < 8 else 1

        self.sp.setEnabled(number(self.tp) > 1)
        self.schedule.setEnabled(number(self.pp) > 1)
        self.virtual_stages.setEnabled(number(self.pp) > 1 and self.schedule.currentData() in VIRTUAL_STAGES)
        self._sync_loss_parallel()

    def _sync_loss_parallel(self, used: bool | None = None) -> None:
        """The vocabulary-split box: live with tensor parallelism; ticked and fixed under Megatron-LM's strategies
        (it always splits the vocabulary); else the user's tick, or until there is one the strategy's default (on
        under FSDP2 as torchtitan, off under DDP, ZeRO and FSDP1). ``used``: the split the last estimate ran, shown
        where the box follows no choice of the user's (a family without a block model keeps the vocabulary whole)."""
        text = self.tp.text().strip()
        tp = int(text) if text.isdigit() and len(text) < 8 else 1
        strategy = str(self.strategy.currentData())
        megatron = strategy in VOCAB_SPLIT_ALWAYS
        choice = self._loss_parallel_choice
        if used is not None and (megatron or choice == "auto"):
            checked = used
        elif megatron or choice == "auto":
            checked = default_loss_parallel(strategy, 2)  # (without tensor parallelism: what it would be)
        else:
            checked = choice == "true"
        blocked = self.loss_parallel.blockSignals(True)
        try:
            self.loss_parallel.setChecked(checked)
        finally:
            self.loss_parallel.blockSignals(blocked)
        self.loss_parallel.setEnabled(tp > 1 and not megatron)
        self.loss_parallel.setToolTip(TOOLTIPS["loss_parallel_megatron" if megatron else "loss_parallel"])

    def show_loss_parallel(self, used: bool, strategy: str, tp: int) -> None:
        """Show the vocabulary split an estimate of the form's strategy and tensor parallelism ran (``used``) where the
        box follows no tick of the user's."""
        if tp > 1 and strategy == self.strategy.currentData() and self.tp.text().strip() == str(tp):
            self._sync_loss_parallel(used)

    def _sync_reshard(self) -> None:
        """Reshard after forward and hybrid replicas are FSDP2's options, live for fsdp2 only; expert tensor
        parallelism is Megatron-LM's, live for its strategies only (their text kept either way)."""
        fsdp2 = self.strategy.currentData() == "fsdp2"
        self.reshard_after_forward.setEnabled(fsdp2)
        megatron = str(self.strategy.currentData()).startswith("megatron")
        for name, live in (("dp_replicate", fsdp2), ("etp", megatron)):
            getattr(self, name).setEnabled(live)
            if name in self.labels:
                self.labels[name].setEnabled(live)

    def _sync_offload(self, wanted: str | None = None) -> None:
        """Offer the offload kinds that differ for the chosen strategy, keeping the closest to ``wanted`` (or to
        the current choice): FSDP's optimizer offload is its CPUOffload, ZeRO-1/2 cannot offload parameters."""
        strategy = str(self.strategy.currentData())
        current = wanted if wanted is not None else str(self.offload.currentData() or "none")
        labels = offload_labels(strategy)
        shown = {self.offload.itemData(i): self.offload.itemText(i) for i in range(self.offload.count())}
        blocked = self.offload.blockSignals(True)
        try:
            if shown != labels:
                self.offload.clear()
                for key, label in labels.items():
                    self.offload.addItem(label, key)
            _set_combo(self.offload, closest_offload(strategy, current))
        finally:
            self.offload.blockSignals(blocked)
        self.offload.setEnabled(len(labels) > 1)
        self.offload.setToolTip(TOOLTIPS["offload"] if len(labels) > 1 else
                                "DDP replicates the model and cannot offload; choose ZeRO or FSDP to offload.")

    def _on_tuning(self, *_: object) -> None:
        self._sync_tuning()
        self._sync_recipe()
        self._changed()

    def _sync_tuning(self) -> None:
        """Enable the fields the chosen method reads: rank, targets and dropout for LoRA/QLoRA, quantization for
        QLoRA, the trainable parts for frozen training (the others keep their text for when they apply again)."""
        method = self.tuning.currentData()
        adapters = method in ("lora", "qlora")
        for name, on in (("lora_rank", adapters), ("lora_targets", adapters), ("lora_dropout", adapters),
                         ("quant", method == "qlora"), ("double_quant", method == "qlora" and
                                                       self.quant.currentData() != "int8"),
                         ("prepare_kbit", method == "qlora"),
                         ("trainable", method == "frozen")):
            self.boxes[name].field.setEnabled(on)
            if name in self.labels:
                self.labels[name].setEnabled(on)

    def set_trainable_info(self, text: str) -> None:
        self.trainable_info.setText(text)
        self.trainable_info.setVisible(bool(text))

    def _checkpointing_value(self) -> str:
        """none, full, or every:N from the checkbox and the every-N-th field (empty or 1: every layer)."""
        if not self.checkpointing.isChecked():
            return "none"
        if self.ckpt_selective.isChecked():
            return "selective"
        text = self.ckpt_every.text().strip()
        return "full" if text in ("", "1") else f"every:{text}"

    def _on_checkpointing(self, *_: object) -> None:
        self._sync_ckpt_every()
        self._changed()

    def _sync_ckpt_every(self) -> None:
        """The every-N-th field applies to layer checkpointing; the per-op box checkpoints every layer."""
        on = self.checkpointing.isChecked()
        self.ckpt_selective.setEnabled(on)
        every = on and not self.ckpt_selective.isChecked()
        self.ckpt_every.setEnabled(every)
        if "ckpt_every" in self.labels:
            self.labels["ckpt_every"].setEnabled(every)

    def _on_loss(self, *_: object) -> None:
        self._sync_loss_chunk()
        self._changed()

    def _on_packing(self, *_: object) -> None:
        self._sync_packing()
        self._changed()

    def _sync_packing(self) -> None:
        """The real tokens apply to packed documents only."""
        used = self.packing.isChecked()
        self.tokens_per_batch.setEnabled(used)
        if "tokens_per_batch" in self.labels:
            self.labels["tokens_per_batch"].setEnabled(used)

    def _sync_loss_chunk(self) -> None:
        """The chunk size applies to the chunked loss only."""
        used = self.loss.currentData() == "chunked"
        self.loss_chunk.setEnabled(used)
        if "loss_chunk" in self.labels:
            self.labels["loss_chunk"].setEnabled(used)

    def _sync_node_size(self) -> None:
        """GPUs per node matters for HYBRID_SHARD and, with offload, for the host memory per node."""
        used = self.strategy.currentData() in NODE_SIZE_STRATEGIES or self.offload.currentData() != "none"
        self.node_size.setEnabled(used)
        if "node_size" in self.labels:
            self.labels["node_size"].setEnabled(used)

    def _on_recipe(self, *_: object) -> None:
        if self._updating:
            return
        key = self.recipe.currentData()
        for rkey, _label, precision, optimizer in RECIPES:
            if rkey == key:
                self._updating = True
                try:
                    _set_combo(self.precision, precision)
                    _set_combo(self.optimizer, optimizer)
                    if rkey in RECIPE_TUNING:  # QLoRA: the method and its checkpointing come with it
                        _set_combo(self.tuning, RECIPE_TUNING[rkey])
                        self.checkpointing.setChecked(True)
                        self._sync_tuning()
                    if optimizer in BNB_OPTIMIZERS and self.optimizer_impl.currentData() == "fused":
                        _set_combo(self.optimizer_impl, "foreach")
                finally:
                    self._updating = False
                break
        self._sync_recipe()
        self._changed()

    def _on_precision_or_optimizer(self, *_: object) -> None:
        self._sync_galore()
        if self._updating:
            return
        self._sync_recipe()
        self._changed()

    def _sync_galore(self) -> None:
        """GaLore's rank applies to GaLore only."""
        used = self.optimizer.currentData() == "galore-adamw"
        self.galore_rank.setEnabled(used)
        if "galore_rank" in self.labels:
            self.labels["galore_rank"].setEnabled(used)

    def _sync_recipe(self) -> None:
        key = recipe_for(self.precision.currentData(), self.optimizer.currentData(),
                         self.tuning.currentData()) or CUSTOM_RECIPE
        was = self._updating
        self._updating = True
        try:
            _set_combo(self.recipe, key)
        finally:
            self._updating = was

    # ---- state --------------------------------------------------------------------------------
    def state(self) -> FormState:
        return FormState(
            model_kind=self.model_kind.currentData(),
            preset=self.preset.currentText().strip(),
            config_path=self.config_path.text().strip(),
            hub_id=self.hub_id.text().strip(),
            params=self.params.text(),
            batch=self.batch.text(),
            seq=self.seq.text(),
            grad_accum=self.grad_accum.text(),
            precision=self.precision.currentData(),
            optimizer=self.optimizer.currentData(),
            optimizer_impl=self.optimizer_impl.currentData(),
            galore_rank=self.galore_rank.text(),
            attention=self.attention.currentData(),
            loss=self.loss.currentData(),
            loss_chunk=self.loss_chunk.text(),
            activation_offload=self.activation_offload.currentData(),
            packing="true" if self.packing.isChecked() else "false",
            tokens_per_batch=self.tokens_per_batch.text(),
            checkpointing=self._checkpointing_value(),
            use_cache="true" if self.use_cache.isChecked() else "false",
            optimizer_in_backward="true" if self.optimizer_in_backward.isChecked() else "false",
            tuning=self.tuning.currentData(),
            lora_rank=self.lora_rank.text(),
            lora_targets=self.lora_targets.currentText(),
            lora_dropout=self.lora_dropout.text(),
            quant=self.quant.currentData(),
            double_quant="true" if self.double_quant.isChecked() else "false",
            prepare_kbit="true" if self.prepare_kbit.isChecked() else "false",
            trainable=self.trainable.text(),
            gpu=self.gpu.currentData() or "",
            capacity=self.capacity.text(),
            cuda_context=self.cuda_context.text(),
            allocator_reserve=self.allocator_reserve.text(),
            gpus=self.gpus.text(),
            strategy=self.strategy.currentData(),
            node_size=self.node_size.text(),
            ep=self.ep.text(),
            tp=self.tp.text(),
            sp="true" if self.sp.isChecked() else "false",
            loss_parallel=self._loss_parallel_choice,
            pp=self.pp.text(),
            cp=self.cp.text(),
            schedule=self.schedule.currentData(),
            virtual_stages=self.virtual_stages.text(),
            reshard_after_forward="true" if self.reshard_after_forward.isChecked() or
            self.strategy.currentData() != "fsdp2" else "false",
            dp_replicate=self.dp_replicate.text(),
            etp=self.etp.text(),
            offload=self.offload.currentData(),
        )

    def set_state(self, state: FormState) -> None:
        """Show ``state`` without emitting ``edited``."""
        self._updating = True
        try:
            _set_combo(self.model_kind, state.model_kind)
            self._sync_kind()
            if self.preset.currentText() != state.preset:
                i = self.preset.findText(state.preset)
                if i >= 0:
                    self.preset.setCurrentIndex(i)
                self.preset.setEditText(state.preset)
            for name in ("config_path", "hub_id", "params", "batch", "seq", "grad_accum", "capacity", "cuda_context",
                         "allocator_reserve", "gpus", "tp", "pp", "cp", "virtual_stages", "node_size", "ep",
                         "etp", "dp_replicate"):
                edit: QLineEdit = getattr(self, name)
                value = getattr(state, name)
                if edit.text() != value:
                    edit.setText(value)
            for name in ("precision", "optimizer", "optimizer_impl", "attention", "strategy", "loss",
                         "activation_offload", "schedule"):
                _set_combo(getattr(self, name), getattr(state, name))
            self.sp.setChecked(state.sp == "true")
            self._loss_parallel_choice = state.loss_parallel if state.loss_parallel in ("true", "false") else "auto"
            self._sync_model_parallel()
            self._sync_offload(state.offload)
            self._sync_node_size()
            self.reshard_after_forward.setChecked(state.reshard_after_forward != "false")
            self._sync_reshard()
            if self.loss_chunk.text() != state.loss_chunk:
                self.loss_chunk.setText(state.loss_chunk)
            self._sync_loss_chunk()
            self.packing.setChecked(state.packing == "true")
            if self.tokens_per_batch.text() != state.tokens_per_batch:
                self.tokens_per_batch.setText(state.tokens_per_batch)
            self._sync_packing()
            if self.galore_rank.text() != state.galore_rank:
                self.galore_rank.setText(state.galore_rank)
            self._sync_galore()
            _set_combo(self.gpu, state.gpu, fallback="")  # a GPU no longer in the table: custom capacity
            self.checkpointing.setChecked(state.checkpointing != "none")
            self.ckpt_selective.setChecked(state.checkpointing == "selective")
            every = state.checkpointing[6:] if state.checkpointing.startswith("every:") else ""
            if self.ckpt_every.text() != every:
                self.ckpt_every.setText(every)
            self._sync_ckpt_every()
            self.use_cache.setChecked(state.use_cache == "true")
            self.optimizer_in_backward.setChecked(state.optimizer_in_backward == "true")
            _set_combo(self.tuning, state.tuning)
            _set_combo(self.quant, state.quant)
            for name in ("lora_rank", "lora_dropout", "trainable"):
                edit = getattr(self, name)
                if edit.text() != getattr(state, name):
                    edit.setText(getattr(state, name))
            if self.lora_targets.currentText() != state.lora_targets:
                self.lora_targets.setEditText(state.lora_targets)
            self.double_quant.setChecked(state.double_quant == "true")
            self.prepare_kbit.setChecked(state.prepare_kbit != "false")
            self._sync_tuning()
            self._sync_recipe()
        finally:
            self._updating = False

    def show_errors(self, errors: dict[str, str]) -> None:
        for name, box in self.boxes.items():
            box.set_error(errors.get(name))
        if "general" not in self.boxes:
            return
        unknown = {k: v for k, v in errors.items() if k not in self.boxes}
        if unknown:
            self.boxes["general"].set_error("; ".join(f"{k}: {v}" for k, v in unknown.items()))

    def errors(self) -> dict[str, str]:
        return {name: box.message() for name, box in self.boxes.items() if box.message()}

    def widget_for(self, name: str) -> QWidget | None:
        box = self.boxes.get(name)
        return box.field if box else None

    def set_model_info(self, text: str) -> None:
        self.model_info.setText(text)

    def set_effective(self, text: str) -> None:
        self.effective.setText(text)

    def changeEvent(self, event: QEvent) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange) and \
                hasattr(self, "boxes"):
            for box in self.boxes.values():
                box._color()
        super().changeEvent(event)
