"""Saved activations of a decoder block, counted tensor by tensor.

Each function lists the tensors autograd keeps alive for backward, derived from the ops of the
transformers implementation of each family and checked byte for byte against a live-storage tracker
on CPU (tests/test_analytic_vs_measured.py). The rules that decide what is kept:

- an op's output survives forward only when a later op saves it: linear layers save their input,
  elementwise products save the operands that the *other* operand's gradient needs, norms save their
  input and statistics, activations save their input (ReLU its output), softmax its output;
- under autocast (``mixed``) every linear casts an fp32 input to 16 bits and saves that copy, once
  per consuming linear (q, k, v separately); norms, softmax and the loss stay fp32;
- SDPA keeps q, k, v, its output and a logsumexp (B·heads·L fp32); eager attention keeps
  contiguous copies of q, k and v (GQA heads repeated), the fp32 softmax probabilities (B·heads·L²)
  plus their 16-bit cast, and a contiguous copy of its output;
- rotary embeddings built with ``torch.cat`` (partial rotary: GPT-NeoX, Phi, Phi-3) make the
  attention output non-contiguous after the transpose, so ``.contiguous()`` copies it;
- with ``use_cache=True`` transformers' DynamicCache concatenates each layer's k and v onto an empty
  tensor (``torch.cat``: copies) and attention runs on the copies (see :func:`cache_changes`);
- Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models", give
  the classic sbh(34 + 5as/h) for GPT-3 blocks; the per-op count here reduces to it for that block
  but follows the actual kernels (no L² term with SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass

from .distributed import BF16_COMPUTE
from .finetune import layer_linears
from .model import ModelSpec
from .setup import TrainingSetup

ROPE_BY_CAT = frozenset({"phi3", "gpt_neox", "phi"})
GEMMA_NORM = frozenset({"gemma"})


@dataclass(frozen=True)
class Dtypes:
    """Element sizes in bytes for one precision preset."""

    param: int  # weights, gradients and optimizer state
    matmul: int  # outputs of linear layers and attention
    autocast: bool  # autocast over fp32 weights: 16-bit copies, fp32 norms and residual stream
    #: autocast over a bf16 model: a no-op for the bf16 weights (measured: full fine-tuning's bytes equal bf16's),
    #: but peft's fp32 adapters and their inputs get autocast's 16-bit copies as under mixed precision
    adapters_autocast: bool = False

    @property
    def residual(self) -> int:
        """The residual stream: embeddings plus residual adds keep the parameter dtype."""
        return self.param

    @staticmethod
    def of(setup: TrainingSetup) -> Dtypes:
        if setup.tuning.method == "qlora" and setup.tuning.prepare_kbit and setup.precision != "mixed":
            # peft's prepare_model_for_kbit_training casts every unquantized weight to fp32 and the 4-bit linears
            # return their input's dtype: without autocast the step runs in fp32 around 16-bit matmuls, with it
            # the model is a mixed-precision one
            return Dtypes(4, 2, True) if setup.precision == "bf16-autocast" else Dtypes(4, 4, False)
        if setup.precision == "fp32":
            return Dtypes(4, 4, False)
        if setup.precision == "mixed" and setup.parallel.strategy in BF16_COMPUTE:
            # FSDP2's MixedPrecisionPolicy (torchtitan): bf16 weights gathered, bf16 compute without autocast; the
            # fp32 sharded weights, gradients and optimizer state are the strategy's (core.distributed); Megatron-LM
            # likewise runs a bf16 model
            return Dtypes(2, 2, False)
        if setup.precision == "bf16":
            return Dtypes(2, 2, False)
        if setup.precision == "bf16-autocast":
            return Dtypes(2, 2, False, adapters_autocast=True)
        return Dtypes(4, 2, True)


def _act_saved_tensors(act: str) -> int:
    """How many I-wide tensors a plain (non-gated) MLP keeps, counting fc1's output."""
    act = act.lower()
    if act in ("gelu_new", "gelu_fast", "gelu_python_tanh"):
        return 5  # 0.5·x·(1 + tanh(c·(x + 0.044715·x³))) in Python ops: x, tanh, 1+tanh, 0.5·x, out
    if act == "relu":
        return 1  # ReLU saves its output only
    if act == "quick_gelu":
        return 3
    return 2  # gelu / gelu tanh / silu kernels: input and output


def norm_saved(spec: ModelSpec, d: Dtypes, rows: int, width: int, casts: int, in_bytes: int) -> dict[str, int]:
    """Tensors a norm keeps (its input included when the norm saves it) and its output as consumed.

    ``casts`` is how many linears consume the output: under autocast each makes its own copy.
    Returns ``{"input": ..., "stats": ..., "output": ...}``; ``input`` is the residual tensor itself
    when the norm saves it (counted once by the caller).
    """
    n = rows * width
    out: dict[str, int] = {"input": 0, "stats": 0, "output": 0}
    if spec.norm == "layernorm":
        out["input"] = n * in_bytes  # native_layer_norm saves its input
        out["stats"] = 2 * rows * 4  # mean and rstd, fp32
        out_bytes = 4 if d.autocast else in_bytes
    else:
        # RMSNorm upcasts to fp32 (saved by pow/mul; it *is* the input when that is fp32), keeps rsqrt,
        # and the normalised tensor (fp32 when the input is fp32, else cast back to the input dtype;
        # Gemma multiplies in fp32 and casts at the end).
        out["input"] = n * 4
        hs_bytes = 4 if (in_bytes == 4 or spec.family in GEMMA_NORM) else in_bytes
        out["stats"] = rows * 4 + n * hs_bytes
        out_bytes = max(d.param, in_bytes) if spec.family not in GEMMA_NORM else in_bytes
    if d.autocast and out_bytes == 4:
        out["output"] = casts * n * 2  # each consuming linear saves its own 16-bit copy
    else:
        out["output"] = n * out_bytes
    return out


def residual_saved(spec: ModelSpec, d: Dtypes) -> bool:
    """Whether a residual-stream tensor is kept: LayerNorm saves it; RMSNorm only when it is fp32."""
    return spec.norm == "layernorm" or d.residual == 4


def cache_changes(spec: ModelSpec, d: Dtypes, tokens: int, attention: str) -> tuple[dict[str, int], int]:
    """What ``use_cache=True`` changes in one layer: (saved tensors replaced, bytes held until forward ends).

    DynamicCache stores ``torch.cat([empty, k])`` and ``torch.cat([empty, v])``, and attention consumes those
    copies, so a k or v that was itself saved is replaced by its copy (no change), except where:

    - a fused qkv projection without rotary (GPT-2): q stays a view of the fused output, which SDPA keeps,
      while k and v are now separate copies: + k + v;
    - a fused qkv projection with rotary (Phi-3, GPT-NeoX, Phi): only v was a view keeping the fused output
      alive; with the cache v is a copy and the fused output is freed: − (q + k);
    - under autocast the rotary k is fp32 (16-bit q times fp32 cos) and SDPA saves its own 16-bit cast, so
      the cache's fp32 copy is extra until the model returns (forward only; the outputs are dropped before
      backward);
    - eager attention with grouped-query heads saves repeated copies, so the cache's k and v are held until
      forward ends.

    Measured on CPU with transformers 5.24 for all presets × fp32/mixed/bf16 (tests/test_analytic_vs_measured.py).
    With gradient checkpointing transformers hands the layers no cache, so nothing changes (the caller skips it).
    """
    kv = spec.kv_dim
    rope = spec.rotary_dim > 0
    k_bytes = max(d.matmul, d.param) if rope else d.matmul
    replaced: dict[str, int] = {}
    held = 0
    if attention == "eager":
        # eager matmuls save their own GQA-repeated (or autocast) copies: the cache's are then extra; GPT-2's are
        # already the contiguous k and v its matmuls would have copied
        if not spec.fused_qkv and spec.num_kv_heads < spec.num_heads:
            held = tokens * kv * (k_bytes + d.matmul)  # repeat_kv copies; without GQA it returns the cache's
        elif rope and d.autocast:
            held = tokens * kv * k_bytes
        return replaced, held
    if spec.fused_qkv and not rope:
        replaced["kv_cache_copies"] = 2 * tokens * kv * d.matmul
    elif spec.fused_qkv:
        replaced["qkv"] = 0
        replaced["v"] = tokens * kv * d.matmul
    if rope and d.autocast:
        held = tokens * kv * k_bytes
    return replaced, held


def attention_saved(spec: ModelSpec, d: Dtypes, batch: int, seq: int, attention: str,
                    use_cache: bool = False, packed: bool = False, cuda: bool = True) -> dict[str, int]:
    """Tensors one attention block keeps, by name (bytes); ``use_cache`` applies :func:`cache_changes`, ``packed``
    an explicit SDPA mask (packed documents, a sliding window: :func:`sdpa_masked`, :func:`packed_sdpa_changes`)."""
    items = _attention_saved(spec, d, batch, seq, attention)
    if packed and attention == "sdpa":
        items.update(packed_sdpa_changes(spec, d, batch, seq, cuda))
    if use_cache:
        replaced, _held = cache_changes(spec, d, batch * seq, attention)
        for name, value in replaced.items():
            if value:
                items[name] = value
            else:
                items.pop(name, None)
    return items


def packed_sdpa_changes(spec: ModelSpec, d: Dtypes, batch: int, seq: int, cuda: bool) -> dict[str, int]:
    """What SDPA keeps differently when documents are packed into rows (transformers 5, measured on CPU).

    transformers finds the documents from the restarting ``position_ids`` (``find_packed_sequence_indices``) and
    builds a block-diagonal causal mask, bool, ``rows × 1 × L × L``. With a mask it repeats grouped k/v heads
    (``use_gqa_in_sdpa`` needs no mask), and PyTorch's SDPA converts the bool mask to an additive one in q's dtype
    in every layer and saves it for backward (CPU flash kernel; CUDA's memory-efficient kernel, which pads its last
    dimension to a multiple of 16). FlashAttention-2's variable-length kernel keeps none of this.
    """
    t = batch * seq
    rope = spec.rotary_dim > 0
    q_bytes = 2 if d.autocast else (max(d.matmul, d.param) if rope else d.matmul)
    cols = -(-seq // 16) * 16 if cuda else seq
    items = {"mask": batch * seq * cols * q_bytes}
    if spec.num_kv_heads < spec.num_heads:  # repeat_kv: all heads, contiguous (and autocast's 16-bit casts)
        items["k"] = t * spec.q_dim * q_bytes
        items["v"] = t * spec.q_dim * d.matmul
        if spec.fused_qkv:  # v was a view of the fused output, kept alive by SDPA; its repeated copy is not
            items["qkv"] = 0
    return items


def sdpa_masked(spec: ModelSpec, setup: TrainingSetup) -> bool:
    """Whether transformers hands SDPA an explicit mask rather than ``is_causal``: packed documents (their
    block-diagonal mask), or a sliding window the sequence reaches (``masking_utils._ignore_causal_mask_sdpa``:
    with a window of W tokens the mask is built once the keys number W or more). Either way it repeats grouped k/v
    heads and SDPA keeps an additive copy of the mask in every layer (:func:`packed_sdpa_changes`; measured on
    Mistral with a 128-token window at 1,024 tokens: 4.5 MiB a layer, to the kilobyte)."""
    if setup.attention != "sdpa":
        return False
    return setup.packing or (spec.sliding_layers > 0 and setup.row_len >= spec.sliding_window > 0)


def sdpa_mask_bytes(spec: ModelSpec, setup: TrainingSetup) -> int:
    """transformers' bool mask (``rows × 1 × L × L``: packed documents' block-diagonal one, or the sliding window's),
    alive while the decoder body runs."""
    return setup.rows * setup.row_len ** 2 if sdpa_masked(spec, setup) else 0


def _attention_saved(spec: ModelSpec, d: Dtypes, batch: int, seq: int, attention: str) -> dict[str, int]:
    """Tensors one attention block keeps, by name (bytes), with ``use_cache=False``."""
    t = batch * seq
    q, kv, m = spec.q_dim, spec.kv_dim, d.matmul
    rope = spec.rotary_dim > 0
    # Rotary output dtype: q (matmul dtype) times cos/sin (parameter dtype) promotes.
    rope_bytes = max(m, d.param) if rope else m
    items: dict[str, int] = {}
    if spec.qk_norm == "rmsnorm":
        hs = 4 if m == 4 else m
        items["qk_norm"] = t * (q + kv) * (4 + hs) + t * (spec.num_heads + spec.num_kv_heads) * 4
    elif spec.qk_norm == "layernorm":
        items["qk_norm"] = t * (q + kv) * (4 if d.autocast else m) + 2 * t * (spec.num_heads + spec.num_kv_heads) * 4
    if attention in ("sdpa", "flash"):  # FlashAttention-2 keeps what SDPA's flash kernel keeps
        sdpa_in = 2 if d.autocast else rope_bytes
        if rope:
            items["q"] = t * q * sdpa_in
            items["k"] = t * kv * sdpa_in
        if spec.fused_qkv:
            items["qkv"] = t * (q + 2 * kv) * m  # v is a view: the fused output stays alive
        else:
            items["v"] = t * kv * m
        items["attn_out"] = t * q * m
        items["logsumexp"] = t * spec.num_heads * 4
        if spec.family in ROPE_BY_CAT and attention == "sdpa":  # flash's output is already (B, L, heads, D)
            items["attn_out_copy"] = t * q * m
        return items
    # eager: matmul keeps contiguous (and, under autocast, 16-bit) copies of q, k and v with all heads.
    copy_bytes = 2 if d.autocast else rope_bytes
    items["q"] = t * q * copy_bytes
    items["k"] = t * q * copy_bytes
    items["v"] = t * q * (2 if d.autocast else m)
    if spec.fused_qkv and not rope:
        pass  # GPT-2: q, k, v are copied out of the fused output, which is then freed
    scores = batch * spec.num_heads * seq * seq
    items["probs"] = scores * 4 + (scores * 2 if m == 2 else 0)
    items["attn_out_copy"] = t * q * m
    return items


def mlp_saved(spec: ModelSpec, d: Dtypes, tokens: int) -> dict[str, int]:
    """Tensors one MLP keeps (bytes)."""
    n = tokens * spec.intermediate_size * d.matmul
    if spec.gated_mlp:
        return {"mlp": 4 * n}  # gate, act(gate), up, act·up
    return {"mlp": _act_saved_tensors(spec.hidden_act) * n}


def linear_casts(spec: ModelSpec) -> tuple[int, int]:
    """How many linears consume the first and the second norm's output."""
    attn = 1 if spec.fused_qkv else 3
    mlp = (1 if spec.fused_gate_up else 2) if spec.gated_mlp else 1
    if spec.norms_per_layer == 1:
        return attn + mlp, 0
    return attn, mlp


def norm_outputs(spec: ModelSpec, setup: TrainingSetup) -> dict[str, int]:
    """Of each norm's entry in :func:`layer_saved`, the output its linears save (their input, or autocast's copies
    of it)."""
    d = Dtypes.of(setup)
    casts = linear_casts(spec)[: spec.norms_per_layer]
    return {f"norm{i + 1}": norm_saved(spec, d, setup.tokens, spec.hidden_size, c, d.residual)["output"]
            for i, c in enumerate(casts)}


def layer_saved(spec: ModelSpec, setup: TrainingSetup) -> dict[str, int]:
    """Everything one decoder layer keeps for backward, by tensor group (bytes)."""
    d = Dtypes.of(setup)
    t = setup.tokens
    h = spec.hidden_size
    items: dict[str, int] = {}
    casts1, casts2 = linear_casts(spec)
    keep_residual = residual_saved(spec, d)
    for idx, casts in enumerate((casts1, casts2)[: spec.norms_per_layer]):
        n = norm_saved(spec, d, t, h, casts, d.residual)
        items[f"norm{idx + 1}"] = n["stats"] + n["output"]
        if spec.norm == "rmsnorm" and d.residual != 4:
            items[f"norm{idx + 1}"] += n["input"]  # the fp32 upcast is a new tensor
    use_cache = setup.use_cache and setup.checkpointing == "none"
    for name, value in attention_saved(spec, d, setup.rows, setup.row_len, setup.attention, use_cache,
                                       sdpa_masked(spec, setup), setup.target_device == "cuda").items():
        items[f"attn.{name}"] = value
    items.update(mlp_saved(spec, d, t))
    n_residual = 1 if spec.parallel_residual else 2
    if keep_residual:
        items["residual"] = n_residual * t * h * d.residual
    return items


# ---- fine-tuning: frozen weights and LoRA adapters ------------------------------------------------------
def selective_saved(spec: ModelSpec, d: Dtypes, batch: int, seq: int, attention: str) -> tuple[int, int]:
    """What a layer keeps under torchtitan's per-op selective checkpointing besides its input: the output of every
    other bias-free matrix product (``aten.mm``, counted in the layer's order; a linear with a bias runs ``addmm``,
    which the policy recomputes) and the attention kernel's output and log-sum-exp (SDPA; eager attention's batched
    products and softmax are recomputed). Returns (all of it, the part alive beside the MLP's working set while the
    layer's forward is at its MLP: the attention block's kept outputs and a kept gate projection, which would
    otherwise die at its activation)."""
    t = batch * seq
    kept = early = count = 0
    for lin in layer_linears(spec):
        bias = spec.qkv_bias if lin.kind in ("q", "k", "v", "qkv") else spec.out_bias if lin.kind == "o" \
            else spec.mlp_bias
        if bias or spec.family == "gpt2":  # GPT-2's Conv1D is addmm whatever its bias
            continue
        count += 1
        if count % 2 == 1:
            kept += t * lin.d_out * d.matmul
            early += t * lin.d_out * d.matmul if lin.kind in ("q", "k", "v", "qkv", "o", "gate") else 0
    if attention == "sdpa":
        out = t * spec.q_dim * d.matmul + batch * spec.num_heads * seq * 4
        kept, early = kept + out, early + out
    return kept, early


def _consumers(spec: ModelSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Linear kinds reading the first and the second norm's output (one norm feeds both in parallel blocks)."""
    attn = ("qkv",) if spec.fused_qkv else ("q", "k", "v")
    mlp = ("gate_up",) if spec.fused_gate_up else (("gate", "up") if spec.gated_mlp else ("up",))
    if spec.norms_per_layer == 1:
        return attn + mlp, ()
    return attn, mlp


def tuned_layer_saved(spec: ModelSpec, setup: TrainingSetup, *, first: bool = False) -> dict[str, int]:
    """What one decoder layer keeps when its weights are frozen and LoRA adapters train (or nothing trains in
    it), following peft's ``LoraLayer.forward`` and autograd's rule that an op saves an input only for a gradient
    that is needed:

    - a frozen linear saves nothing (its input is only needed for its own weight gradient);
    - a frozen RMSNorm weight drops the normalised tensor saved for the weight gradient; the norm's input and
      statistics stay while the input requires a gradient (not in the first layer, fed by frozen embeddings);
    - every adapted linear: ``lora_A`` saves its input — the same tensor when it already has the adapter dtype
      (fp32 base, no dropout), otherwise its own cast (peft casts x to the adapter dtype; autocast then casts to
      16 bits), so q, k and v each keep a copy; ``lora_B`` saves ``lora_A``'s r-wide output;
    - LoRA dropout (p > 0): each adapted module keeps its dropout output and mask (the mask in the input dtype on
      CPU, as bool on CUDA), the mask only where the input requires a gradient;
    - the MLP's down-projection input (act·up, or act(fc1)) is kept only for an adapter on the down projection.

    Measured with peft 0.21 on CPU (tests/test_analytic_vs_measured.py).
    """
    ft = setup.tuning
    d = Dtypes.of(setup)
    t = setup.tokens
    h, inter = spec.hidden_size, spec.intermediate_size
    adapted = {lin.kind: lin for lin in ft.adapted(spec)}
    norms_train = "norms" in {p.strip().lower() for p in ft.trainable}
    a_bytes = 2 if ft.adapter_dtype == "bf16" else 4
    mask_bytes = 1 if setup.target_device == "cuda" else None  # None: the input's element size
    # lora_A's input gets autocast's 16-bit copy: under mixed precision, or fp32 adapters under bf16 autocast
    autocast_copy = d.autocast or (d.adapters_autocast and a_bytes == 4)
    items: dict[str, int] = {}

    def lora_inputs(kinds: tuple[str, ...], n: int, x_bytes: int, requires_grad: bool, kept: bool) -> int:
        """What the adapters among ``kinds`` keep of their shared input x (n elements); ``kept``: x is saved by
        another op anyway (attention output, MLP activations)."""
        mine = [k for k in kinds if k in adapted]
        if not mine:
            return 0
        if ft.dropout > 0:  # dropout runs on peft's cast of x to the adapter dtype
            mask = (mask_bytes or a_bytes) * n if requires_grad else 0
            saved = 2 * n if autocast_copy else a_bytes * n
            return len(mine) * (saved + mask)
        if autocast_copy:
            return len(mine) * 2 * n  # lora_A's autocast copy, one per module
        if x_bytes != a_bytes:
            return len(mine) * a_bytes * n  # peft's cast, one per module
        return 0 if kept else x_bytes * n  # the same tensor, once

    attn_grad, after_attn, mlp_grad = _gradient_flow(spec, set(adapted), norms_train, first)
    consumers = _consumers(spec)
    for idx in range(spec.norms_per_layer):
        requires = not first if idx == 0 else after_attn
        n = norm_saved(spec, d, t, h, 1, d.residual)
        kept = 0
        if spec.norm == "layernorm":
            kept = n["stats"] if (requires or norms_train) else 0  # its input is the residual stream (below)
            out_bytes = 4 if d.autocast else d.residual
        else:
            if requires:
                kept = t * 4 + (n["input"] if d.residual != 4 else 0)  # rstd (+ the fp32 upcast of a 16-bit stream)
            if norms_train:
                kept += n["stats"] - t * 4
            out_bytes = max(d.param, d.residual) if spec.family not in GEMMA_NORM else d.residual
        kept += lora_inputs(consumers[idx], t * h, out_bytes, requires or norms_train, kept=False)
        items[f"norm{idx + 1}"] = kept
    # attention: what SDPA/eager keep is unchanged (q, k or v requires a gradient from the adapters on)
    full_attn = attention_saved(spec, d, setup.rows, setup.row_len, setup.attention,
                                setup.use_cache and setup.checkpointing == "none", sdpa_masked(spec, setup),
                                setup.target_device == "cuda")
    for name, value in full_attn.items():
        items[f"attn.{name}"] = value if attn_grad else 0
    if spec.qk_norm == "rmsnorm" and not norms_train and attn_grad:
        # frozen q/k norm weights: the normalised tensor is not kept
        items["attn.qk_norm"] -= t * (spec.q_dim + spec.kv_dim) * (4 if d.matmul == 4 else d.matmul)
    items["attn.o_lora"] = lora_inputs(("o",), t * spec.q_dim, d.matmul, attn_grad, kept=attn_grad)
    # bitsandbytes' quantized linears return their input's dtype (Linear4bit: ``out.to(inp_dtype)``), so under
    # autocast a QLoRA layer's projections come out in fp32 where a 16-bit base gives autocast's 16 bits
    out_bytes_q = max(d.param, d.residual) if ft.method == "qlora" and d.autocast else d.matmul
    # MLP
    full_mlp = mlp_saved(spec, d, t)["mlp"] * out_bytes_q // d.matmul
    tI = t * inter * out_bytes_q
    relu = not spec.gated_mlp and spec.hidden_act.lower() == "relu"
    items["mlp"] = (full_mlp if relu else full_mlp - tI) if mlp_grad else 0  # down's input goes with its weight
    items["mlp.down_lora"] = lora_inputs(("down",), t * inter, out_bytes_q, mlp_grad, kept=relu and mlp_grad)
    # the r-wide lora_A outputs lora_B keeps
    r_bytes = 2 if d.autocast or d.adapters_autocast else a_bytes
    items["lora_rank"] = len(adapted) * t * ft.rank * r_bytes
    n_residual = 1 if spec.parallel_residual else 2
    if residual_saved(spec, d):
        kept_streams = n_residual - (1 if first else 0) - (1 if first and n_residual == 2 and not after_attn else 0)
        items["residual"] = kept_streams * t * h * d.residual
    return items


def _gradient_flow(spec: ModelSpec, adapted: set[str], norms_train: bool, first: bool) -> tuple[bool, bool, bool]:
    """Where gradients flow in a layer with frozen weights: (attention tensors, after the attention, inside the
    MLP). Only the first layer, fed by frozen embeddings, differs: gradients start at its first adapter (or its
    trainable first norm) — attention keeps its tensors after an adapted q/k/v, the rest after any attention
    adapter, the MLP after the attention or its own gate/up adapters (one norm feeds both in parallel blocks)."""
    if not first:
        return True, True, True
    attn = norms_train or bool(adapted & {"q", "k", "v", "qkv"})
    after = attn or "o" in adapted
    # the MLP reads the post-attention stream, or in a parallel block the same norm output as the attention
    mlp = (after and not spec.parallel_residual) or norms_train or bool(adapted & {"gate", "up", "gate_up"})
    return attn, after, mlp


def first_layer_gradless_weights(spec: ModelSpec, setup: TrainingSetup) -> int:
    """Weights of the first layer's linears whose input needs no gradient (frozen embeddings, nothing adapted
    before them): their autocast copies are not kept for backward, since only a needed input gradient uses them."""
    adapted = {lin.kind for lin in setup.tuning.adapted(spec)}
    attn, after, _mlp = _gradient_flow(spec, adapted, False, True)
    mlp_in = after and not spec.parallel_residual
    grad_in = {"q": False, "k": False, "v": False, "qkv": False, "o": attn,
               "down": mlp_in or bool(adapted & {"gate", "up", "gate_up"})}
    return sum(lin.weight_params for lin in layer_linears(spec) if not grad_in.get(lin.kind, mlp_in))
