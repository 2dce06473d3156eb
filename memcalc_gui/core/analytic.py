"""Method ``analytic``: the phase ledger of one steady-state training step, tensor by tensor.

The step is followed as PyTorch runs it (Hugging Face blog's phases, memory ledger's ledger):

- ``load``: the parameters;
- ``forward``: parameters (+ the 16-bit weight copies autocast caches), optimizer state (it exists
  from the first step on), gradients only with accumulation > 1, the inputs, and every saved
  activation; the peak is at the loss, where the logits, their fp32 copy and log-softmax coexist;
- ``backward``: the largest of the moments where memory can peak: the cross-entropy backward (two
  logits-sized fp32 gradients beside the log-softmax), the LM-head backward (its weight gradient
  appears), the first and the last decoder layer (activations are freed while gradients appear),
  and the embedding backward;
- ``optimizer_step``: parameters, all gradients, state and the step temporaries of the chosen
  implementation; ``zero_grad(set_to_none=True)`` then frees the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import (
    GEMMA_NORM,
    Dtypes,
    cache_changes,
    first_layer_gradless_weights,
    layer_saved,
    mlp_saved,
    norm_outputs,
    norm_saved,
    residual_saved,
    sdpa_mask_bytes,
    sdpa_masked,
    selective_saved,
    tuned_layer_saved,
)
from .distributed import BF16_COMPUTE, VOCAB_SPLIT_ALWAYS, ModelStates, Parallelism, model_states
from .errors import InputError
from .finetune import FineTuning, layer_linears
from .layout import tensor_parallel_spec
from .ledger import Estimate, with_overheads
from .loss import chunk_transient_bytes, liger_chunk_rows
from .model import ModelSpec
from .optimizer import optimizer_cost
from .setup import TrainingSetup, checkpoint_every
from .units import ordinal

#: cross_entropy's target bookkeeping: padded labels (B·(L+1)) and shifted labels (B·L), int64.
LABEL_BYTES = 8


def _objects(**kw: int) -> dict[str, int]:
    return {k: int(v) for k, v in kw.items() if v}


def flash_backward_bytes(spec: ModelSpec, d: Dtypes, tokens: int, documents: int) -> int:
    """What FlashAttention-2's variable-length backward holds at once (``mha_varlen_bwd``, flash-attn
    ``csrc/flash_attn/flash_api.cpp``): the output's gradient, dq, dk and dv (with every head when k/v heads are
    grouped, then summed), the fp32 dq accumulator of ``(tokens + 128·documents) × heads × head_dim`` rounded up
    to 32, and the fp32 softmax row sums."""
    rows = tokens + 128 * documents
    head_dim = spec.q_dim // spec.num_heads
    kv = spec.q_dim if spec.num_kv_heads < spec.num_heads else spec.kv_dim
    return (tokens * (2 * spec.q_dim + 2 * kv) * d.matmul + rows * spec.num_heads * (-(-head_dim // 32) * 32) * 4
            + spec.num_heads * rows * 4)


def attention_transients(spec: ModelSpec, setup: TrainingSetup, d: Dtypes) -> int:
    """What an attention block holds at its kernel beyond what it saves (measured on CPU): autocast's fp32 inputs
    of the 16-bit casts SDPA makes; with packed grouped heads, the k and v before ``repeat_kv``; eager's
    masked scores (beside the softmax output), a 16-bit model's fp32 upcast of them inside the softmax, and its
    additive mask, ``rows × 1 × L × L`` in the model's dtype."""
    t, q, kv = setup.tokens, spec.q_dim, spec.kv_dim
    m, rope = d.matmul, spec.rotary_dim > 0
    rope_bytes = max(m, d.param) if rope else m
    if setup.attention == "eager":
        # a 16-bit model's softmax(dtype=float32) first upcasts its input (an fp32 copy of the scores), while the
        # 16-bit copy of the probabilities that attention saves (counted among its saved tensors) is made only after
        # it: 4 − 2 bytes a score (traced on a bf16 Llama at 1,024 tokens, the forward peak at the last softmax)
        upcast = (4 - 2) * spec.num_heads if m == 2 and not d.autocast else 0
        return setup.rows * setup.row_len ** 2 * (spec.num_heads * m + d.param + upcast)
    repeated = sdpa_masked(spec, setup) and spec.num_kv_heads < spec.num_heads
    out = t * kv * (rope_bytes + m) if repeated else 0
    if d.autocast and rope:
        out += t * (q + (q if repeated else kv)) * rope_bytes
    return out


def estimate_analytic(setup: TrainingSetup) -> Estimate:
    """The analytic ledger for a setup that describes an architecture."""
    if setup.model is None:
        raise ValueError("the analytic method needs an architecture (preset or config.json)")
    if setup.parallel.pp > 1:  # the most loaded pipeline rank: its stage's ledger and the schedule's additions
        from .pipeline import pipeline_estimate

        return pipeline_estimate(setup)
    if setup.parallel.cp > 1:  # one context-parallel rank: the model at seq/cp tokens, plus ring attention's chunks
        from .context import context_parallel_estimate

        return context_parallel_estimate(setup)
    # one rank of a tensor-parallel group
    spec = tensor_parallel_spec(setup.model, setup.parallel.tp, setup.parallel.loss_parallel)
    d = Dtypes.of(setup)
    b, seq = setup.rows, setup.row_len  # packed documents: one row of every real token
    t = b * seq
    h, v = spec.hidden_size, spec.vocab_size
    n_layers = spec.num_layers
    n_params = spec.num_params
    # FSDP2 under mixed precision computes in bf16, but its weights, gradients and optimizer state are fp32
    p = 4 if setup.precision == "mixed" and setup.parallel.strategy in BF16_COMPUTE else d.param

    ft = setup.tuning
    tuned = ft.method != "full"
    params = n_params * p
    copies = spec.matmul_weight_params * 2 if d.autocast else 0
    lm_copy = v * h * 2 if d.autocast and spec.stage_last else 0  # a pipeline stage before the last has no head
    layout = spec.param_layout()
    if tuned:
        tp = trainable_parts(spec, ft, p)
        params, copies, layout = tp.params_bytes, (tp.copies_bytes if d.autocast else 0), tp.layout
        if d.autocast and ft.uses_adapters and ft.method == "lora":
            copies -= 2 * first_layer_gradless_weights(spec, setup)
        if d.adapters_autocast and ft.uses_adapters and ft.adapter_dtype == "fp32":
            copies = 2 * ft.adapter_params(spec)  # autocast's bf16 copies of the adapters; the bf16 base needs none
    opt = optimizer_cost(setup.optimizer, setup.optimizer_impl, layout, tp.layout_layers if tuned else n_layers,
                         tp.grad_bytes if tuned else p, paging=setup.target_device == "cuda",
                         galore_rank=setup.galore_rank)
    state = opt.state_bytes
    paged = opt.paged_bytes
    grads_all = tp.grads_bytes if tuned else n_params * p
    accumulating = setup.grad_accum > 1
    inputs = t * 8 * (2 if setup.packing else 1)  # input_ids (labels share the tensor), packed: position_ids

    # ---- saved activations ------------------------------------------------------------------
    # a layer whose weights train keeps what full training keeps; a frozen one what its adapters need
    per_layer = layer_saved(spec, setup) if not tuned or tp.layers_trained else tuned_layer_saved(spec, setup)
    sp = setup.parallel.tp if setup.parallel.sp else 1
    if sp > 1:
        # sequence parallelism (Korthikanti et al. 2022): the norms and the residual stream are split along the
        # sequence over the tensor-parallel ranks. Megatron-LM's column-parallel linears save their input split too
        # and gather it again in backward (the way beside DDP, ZeRO and Megatron's own optimizers); PyTorch's plan,
        # torchtitan's with FSDP2 (PrepareModuleInput gathers before attention and the MLP), saves the gathered input,
        # whole (traced, and real gloo ranks give the single-GPU loss)
        whole = norm_outputs(spec, setup) if setup.parallel.strategy == "fsdp2" else {}
        per_layer = {k: (-(-(val - whole.get(k, 0)) // sp) + whole.get(k, 0)
                         if k.startswith("norm") or k == "residual" else val)
                     for k, val in per_layer.items()}
    s_layer = sum(per_layer.values())
    stream = -(-t * h * d.residual // sp)
    rope_tables = 2 * seq * spec.rotary_dim * p
    final = norm_saved(spec, d, t, h, 1, d.residual)
    final_saved = final["stats"] + final["output"]
    if spec.norm == "rmsnorm" and d.residual != 4:
        final_saved += final["input"]  # the fp32 upcast of a 16-bit stream is a new tensor
    if not spec.stage_last:  # a pipeline stage before the last: no final norm
        final = dict.fromkeys(final, 0)
        final_saved = 0
    keep_stream = residual_saved(spec, d)
    final_out_held = 0  # a final-norm output nothing saves but the model's outputs hold until forward returns
    first_layer = s_layer
    if tuned:
        # frozen norm weights: the final norm keeps its statistics (and a 16-bit stream's upcast); its output is
        # saved only for a trainable head, otherwise it is alive until the model returns
        final_saved = t * 4 + (final["input"] if spec.norm == "rmsnorm" and d.residual != 4 else 0)
        if spec.norm == "layernorm":
            final_saved = final["input"] + final["stats"]
        if tp.norms_trainable:
            final_saved = final["stats"] + (final["input"] if spec.norm == "rmsnorm" and d.residual != 4 else 0)
        if tp.head_trainable:
            final_saved += final["output"]
        else:
            final_out_held = t * h * max(d.param, d.residual) if not d.autocast else 0
        if not tp.embeddings_trainable and not tp.layers_trained:
            first_layer = sum(tuned_layer_saved(spec, setup, first=True).values())
        keep_stream = keep_stream and tp.embeddings_trainable  # the embedding output needs no gradient
    every = checkpoint_every(setup.checkpointing)
    every = None if every == 1 else every  # every:1 is full checkpointing
    n_ck = n_layers // every if every else 0  # layers N, 2N, … (torchtitan's ac_freq)

    def checkpointed(j: int) -> bool:  # decoder layer j (1-based)
        return ckpt or (every is not None and j % every == 0)

    # per-op selective checkpointing (torchtitan): each layer also keeps some matmul and attention outputs
    sac, sac_early = selective_saved(spec, d, b, seq, setup.attention) if setup.checkpointing == "selective" \
        else (0, 0)
    if setup.checkpointing in ("full", "every:1", "selective"):
        # Non-reentrant checkpointing keeps each layer's input; the final norm keeps the last output.
        layers_saved = n_layers * (stream + sac) + (stream if keep_stream else 0)
        ckpt = True
    elif tuned and not ft.uses_adapters:
        # frozen parts: trained layers keep what full training keeps; frozen layers keep what gradients flowing
        # through them need when something below trains (embeddings, norms), otherwise nothing
        frozen = n_layers - tp.layers_trained
        s_frozen = sum(tuned_layer_saved(spec, setup).values())
        if tp.embeddings_trainable:
            below = frozen * s_frozen
        elif tp.norms_trainable and frozen:
            below = sum(tuned_layer_saved(spec, setup, first=True).values()) + (frozen - 1) * s_frozen
        else:
            below = 0
        layers_saved = tp.layers_trained * s_layer + below
        ckpt = False
    elif every is not None:
        # every N-th layer checkpointed (layers N, 2N, …): those keep their input, the others what they save
        layers_saved = n_ck * stream + (n_layers - n_ck) * s_layer + (stream if keep_stream else 0)
        ckpt = False
    else:
        layers_saved = (n_layers - 1) * s_layer + first_layer + (stream if keep_stream else 0)  # + embedding out
        ckpt = False
    # packed SDPA's bool mask: a checkpointed layer keeps it (an input of its recomputation) through backward
    model_saved = rope_tables + final_saved + (sdpa_mask_bytes(spec, setup) if ckpt or n_ck else 0)
    acts_fwd = layers_saved + model_saved
    # use_cache=True: the DynamicCache's copies that nothing saves live until the model returns
    cache_held = (n_layers - n_ck) * cache_changes(spec, d, t, setup.attention)[1] \
        if setup.use_cache and not ckpt else 0

    # ---- activation offloading ---------------------------------------------------------------
    # What the decoder body saves goes to the host as it is saved (save_on_cpu; torchtune's OffloadActivations); the
    # head and the loss run after the body and keep theirs (the head's input). Checkpointed layers keep the rotary
    # tables their recomputation is called with; without checkpointing those exist only as host copies after forward.
    offload = setup.activation_offload
    head_in = final["output"]
    kept_fwd = acts_fwd if offload == "none" else head_in + (rope_tables if ckpt else 0)
    offload_host = 0
    if offload != "none":
        # a tensor saved by two ops is copied twice: RMSNorm's fp32 input (pow and mul) and rsqrt (mul and its own
        # backward); without autocast q/k/v (and gate/up) save the one normalised input each
        norm_dup = t * h * 4 + t * 4 if spec.norm == "rmsnorm" else 0
        offload_host = acts_fwd - head_in - (rope_tables if ckpt else 0) + inputs + norm_dup
        if not ckpt:  # every linear's saved weight (its 16-bit cast under autocast) is copied too
            shared = 0 if d.autocast else (2 + (1 if spec.gated_mlp else 0)) * t * h * d.matmul
            offload_host += (spec.matmul_weight_params - v * h) * (2 if d.autocast else p) + n_layers * (
                rope_tables + spec.norms_per_layer * norm_dup + shared)

    # ---- forward peak: at the loss ----------------------------------------------------------
    logits = t * v * d.matmul
    logits32 = t * v * 4 if d.matmul != 4 else 0
    lsm = t * v * 4
    labels = b * (seq + 1) * LABEL_BYTES + t * LABEL_BYTES
    final_out_alive = t * h * 4 if d.autocast else 0  # fp32 norm output held by the model's outputs
    final_out_alive += final_out_held
    stage_out = 0
    if not spec.stage_last:
        # a pipeline stage before the last ends at its last layer's output, which the schedule keeps (and sends)
        logits = logits32 = lsm = labels = final_out_alive = 0
        stage_out = t * h * d.residual
    grads_live = grads_all if accumulating else 0
    if tuned and ckpt and d.autocast:
        # inside checkpointed layers nothing is saved, and autocast caches casts of trainable weights only: the
        # frozen layers' 16-bit copies are transients; the head's (saved for its input gradient) and the adapters'
        # (cached) remain
        copies = lm_copy + 2 * (ft.adapter_params(spec) if ft.uses_adapters else tp.grads_bytes // tp.grad_bytes)
    chunked = setup.loss == "chunked"
    if chunked and lm_copy:  # the head's 16-bit cast is made per chunk and freed (core.loss), not kept
        copies, lm_copy = max(0, copies - lm_copy), 0
    base_fwd = dict(parameters=params + copies, optimizer_state=state, gradients=grads_live, inputs=inputs)

    def copies_saved(made: int) -> int:
        """The 16-bit weight copies that outlive autocast's cache: those saved for backward."""
        return lm_copy if ckpt or offload != "none" else \
            made - n_ck * (spec.layer_params - spec.norms_per_layer * h * (2 if spec.norm_bias else 1)) * 2 * d.autocast

    loss_fwd = base_fwd
    if spec.stage_last and not spec.stage_first:
        # a pipeline's last stage: the schedule computes the loss once the stage's forward has returned, autocast's
        # cache dropped and the final norm's output with it
        loss_fwd = dict(base_fwd, parameters=params + copies_saved(copies))
        final_out_alive = 0
    # QLoRA: a 4-bit linear's weight is dequantized into a 16-bit transient for its matmul (forward and backward)
    dequant = 2 * max(lin.weight_params for lin in layer_linears(spec)) if ft.method == "qlora" else 0
    head_trains = (not tuned or tp.head_trainable) and spec.stage_last
    # no gradient below the head (only the head trains): no hidden-state gradient, no layer moments
    head_only = tuned and not ft.uses_adapters and not tp.layers_trained and \
        not (tp.embeddings_trainable or tp.norms_trainable)
    if chunked:
        # core.loss: the hidden-state and head-weight gradients made in forward, one chunk's transients at a time;
        # the head keeps no input (its fp32 output under autocast stays held until forward returns)
        head_saved = final["output"] if (not tuned or tp.head_trainable) else 0
        grad_x = 0 if head_only else t * h * (4 if d.autocast else max(d.param, d.residual))
        grad_w32 = v * h * 4 if head_trains else 0
        rows = setup.loss_chunk or liger_chunk_rows(t, h, v)
        chunk_tmp = chunk_transient_bytes(min(rows, t), v, h, d.matmul, setup.target_device,
                                          d.autocast and head_trains)
        chunk_acts = kept_fwd - (head_saved if d.autocast else 0) + grad_x + cache_held
        forward = _objects(**dict(base_fwd, gradients=grads_live + grad_w32), activations=chunk_acts,
                           temporaries=labels + final_out_alive + chunk_tmp)
        if grad_w32 and p != 4:  # the fp32 accumulator cast to the weight's dtype at the end of forward
            forward = max(forward, _objects(**dict(base_fwd, gradients=grads_live + grad_w32 + v * h * p),
                                            activations=chunk_acts, temporaries=labels + final_out_alive),
                          key=lambda m: sum(m.values()))
    else:
        forward = _objects(**loss_fwd, activations=kept_fwd + lsm + cache_held + stage_out,
                           temporaries=logits + logits32 + labels + final_out_alive)
    # Inside a checkpointed layer nothing is saved, but its MLP still holds ~3 I-wide tensors at once (4 for the tanh
    # GELU transformers writes in Python ops: fc1's output, x³, and two products)
    wide = 4 if not spec.gated_mlp and spec.hidden_act.lower() in ("gelu_new", "gelu_fast", "gelu_python_tanh") else 3
    fwd_candidates = [("loss", forward)]
    if spec.stage_last and not spec.stage_first and not chunked:
        # a pipeline's last stage at its head, inside the stage's forward: autocast's copies all cached, the final
        # norm's output (fp32 under autocast) beside the logits
        fwd_candidates.append(("head", _objects(**base_fwd, activations=kept_fwd + cache_held,
                                                temporaries=logits + final["output"] + (t * h * 4 if d.autocast
                                                                                        else 0))))
        forward = max(forward, fwd_candidates[-1][1], key=lambda m: sum(m.values()))
    fsdp2_stage = setup.parallel.strategy == "fsdp2" and setup.parallel.ep == 1  # (its own moments below)
    if not spec.stage_last and not fsdp2_stage and not (ckpt or n_ck or offload != "none"):
        # a pipeline stage before the last peaks at its last layer's residual add: everything saved, the MLP's
        # output and the sum being made (where the stream is saved as it is, the sum is the last saved tensor),
        # beside what the frames hold where it is not (a 16-bit stream's RMSNorm saves its fp32 upcast): the
        # attention block's sum and, above a first layer, the layer's input (traced on one- and two-layer stages;
        # their input, a receive buffer, is core.pipeline's)
        held = -stream if keep_stream else stream * (2 if n_layers > 1 else 1)
        fwd_candidates.append(("layer-end", _objects(**loss_fwd, activations=kept_fwd + cache_held,
                                                     temporaries=t * h * d.matmul + stage_out + held)))
        forward = max(forward, fwd_candidates[-1][1], key=lambda m: sum(m.values()))
    mask = sdpa_mask_bytes(spec, setup)  # packed SDPA's bool mask: alive while the decoder body runs
    attn_part = sum(val for key, val in per_layer.items() if key.startswith("attn.")) + per_layer["norm1"]
    # a checkpointed layer at its attention kernel: the attention's tensors and the first norm's output
    attn_at_kernel = attn_part - per_layer["norm1"] + t * h * (
        d.residual if spec.family in GEMMA_NORM else 4 if d.autocast else max(d.param, d.residual))
    attn_at_kernel += attention_transients(spec, setup, d)
    if ckpt or n_ck or offload != "none":
        # offloaded: no layer keeps anything on the device, but the layer's own frames hold four residual-stream
        # tensors at its MLP (its input, the residual, the norm's output, the attention block's sum; measured on
        # Llama, Qwen2 and GPT-2, which holds a little more at its attention: within 2.4 %)
        streams = 1 if offload == "none" else 4
        in_layer = _objects(**base_fwd, activations=(layers_saved if offload == "none" else 0) + rope_tables,
                            temporaries=wide * t * spec.intermediate_size * d.matmul + dequant +
                            streams * t * h * d.residual)
        if ckpt and offload == "none":
            # every layer checkpointed (per-op selective: also its kept outputs): the layers below keep their input
            # (and kept outputs), this one its input and what it kept so far; beside the MLP's working set its frames
            # hold the attention block's residual sum and the norm's output (GPT-2 also its attention output, in a
            # tuple, and the token and position embeddings); the final norm has not run yet
            held = 2 * t * h * d.residual + ((2 * t + seq) * h * d.residual if spec.family == "gpt2" else 0)
            # (autocast has not yet cast this layer's MLP output projection, nor the head's weight: traced on a
            # pipeline stage of one layer, 1.9 % over when counted)
            unmade = h * spec.intermediate_size * 2 + lm_copy if d.autocast and not tuned else 0
            in_layer = _objects(**dict(base_fwd, parameters=base_fwd["parameters"] - unmade),
                                activations=n_layers * stream + (n_layers - 1) * sac + sac_early +
                                rope_tables, temporaries=wide * t * spec.intermediate_size * d.matmul + held + mask)
            if setup.checkpointing != "selective":
                # at the attention kernel of a checkpointed layer: what attention would save (packed SDPA's
                # masks, eager's probabilities beside the scores they come from) and the norm output feeding it
                # autocast has not yet cast this layer's output projection and MLP weights, nor the head's
                later = (spec.mlp_params + h * spec.q_dim) * 2 + lm_copy if d.autocast and not tuned else 0
                fwd_candidates.append(("attention", _objects(
                    **dict(base_fwd, parameters=base_fwd["parameters"] - later),
                    activations=n_layers * stream + rope_tables,
                    temporaries=attn_at_kernel + mask)))
        fwd_candidates.append(("layer", in_layer))
        forward = max([forward, in_layer] + [m for _, m in fwd_candidates[1:]], key=lambda m: sum(m.values()))
    elif setup.attention == "eager" and not tuned and spec.stage_last:
        # eager attention's L×L scores outgrow the loss's logits past a few hundred tokens: the last layer at its
        # softmax, the layers below keeping what they save, this one its attention block so far (the softmax output
        # among it), beside the kernel's masked scores and mask. Autocast has not yet cast this layer's output
        # projection and MLP weights, nor the head's. Measured on a Llama of hidden 128 at 1,024 tokens: the forward
        # peak is here (69.66 MiB), where the loss read 12.9 % under
        later = (spec.mlp_params + h * spec.q_dim) * 2 + lm_copy if d.autocast else 0
        below = kept_fwd - s_layer + (s_layer - first_layer if n_layers == 1 else 0)
        fwd_candidates.append(("attention", _objects(
            **dict(base_fwd, parameters=base_fwd["parameters"] - later),
            activations=below + attn_part + cache_held,
            temporaries=attention_transients(spec, setup, d) + mask)))
        forward = max(forward, fwd_candidates[-1][1], key=lambda m: sum(m.values()))

    fsdp2 = setup.parallel.strategy == "fsdp2" and setup.parallel.ep == 1
    # FSDP2 over a whole model, not a pipeline stage: it reduce-scatters each micro-batch's gradients
    fsdp2_whole = fsdp2 and spec.stage_first and spec.stage_last
    if fsdp2:
        # FSDP2 copies the last layer's all-gather output into its unsharded parameters as that layer's forward
        # starts: what the layers below saved and, over a whole model, that layer's input, the stream the layer below
        # returned (traced: with every layer checkpointed, the embedding's output and each layer's beside it); a
        # pipeline stage's schedule holds it already (core.pipeline; counted again, a one-layer middle stage read
        # 1.5 % over). No temporaries (fsdp2_ledger adds the gathered layers). A model or stage-chunk of one layer has
        # no such moment: its one layer is the first, gathered beside the root unit's output (below; counted as a
        # layer's beside a layer's kept output it read 10.6 % over a real one-layer Llama-3.1-8B rank, tp 2 × FSDP2
        # over 2, and an interleaved rank of one-layer chunks with checkpointing 3.2 % over its trace)
        if n_layers > 1:
            fwd_candidates.append(("gather", _objects(**base_fwd, activations=layers_saved * (n_layers - 1) // n_layers
                                                      + (stream if fsdp2_whole else 0) + rope_tables)))
        # ... and the first layer's, while the root unit's all-gather output is the one kept: the embedding's output
        fwd_candidates.append(("gather-first", _objects(**base_fwd, activations=stream + rope_tables)))
        if setup.parallel.sp and setup.parallel.loss_parallel and spec.stage_first:
            # the vocabulary-split embedding at work: its output, partial over the tensor-parallel ranks and the whole
            # sequence long, and the reduce-scatter's input made from it (traced: a first pipeline stage with every
            # micro-batch in flight peaks here, 2.4 % under without it)
            fwd_candidates.append(("embedding", _objects(**base_fwd, activations=2 * t * h * d.residual)))
        if not (ckpt or n_ck or offload != "none"):
            # the last layer's output projection, with the layer still gathered: what every layer saved, its output
            # and the residual stream it is added into (under tensor parallelism the all-reduce's output); nothing
            # of the head yet, whose logits need no gathered layer (traced: a layer outweighs them on small models)
            # (a 16-bit RMSNorm saves its fp32 upcast, not the stream: the model's embedding output, the layer's
            # input and its attention block's sum are held by their frames beside what is saved; a saved stream's
            # last tensor, the final norm's input, is the one being made)
            held = -stream if keep_stream else 3 * stream
            fwd_candidates.append(("layer", _objects(**base_fwd, activations=acts_fwd - final_saved + cache_held,
                                                     temporaries=t * h * d.matmul + stream + held)))
        if not (spec.stage_first and spec.stage_last):
            # a pipeline stage's first layer at work, what it keeps so far (its forward after a backward holds every
            # unit that backward gathered: core.pipeline)
            first_kept = stream + sac_early if ckpt else first_layer + (stream if keep_stream else 0)
            fwd_candidates.append(("layer-first", _objects(
                **base_fwd, activations=first_kept + rope_tables,
                temporaries=in_layer["temporaries"] if ckpt and offload == "none" else 0)))

    # ---- backward moments -------------------------------------------------------------------
    moments: list[dict[str, int]] = []
    where: list[tuple[str, int]] = []  # each moment: loss, head, mlp/attn of layer k, embedding (FSDP2)
    # (A) cross-entropy backward: log-softmax + its gradient + the logits gradient, all fp32.
    # With checkpointing the layers' 16-bit weight copies die with autocast's cache after forward.
    # every N-th layer: the checkpointed layers' copies die too, the others' stay saved
    copies_bwd = copies_saved(copies)
    base_bwd = dict(base_fwd, parameters=params + copies_bwd)
    lm_grad = v * h * p if head_trains else 0
    if chunked:
        # (A') the loss backward scales the two gradients in place: the head's becomes .grad (or is added to it)
        where.append(("loss", 0))
        moments.append(_objects(**dict(base_bwd, gradients=(grads_all if accumulating else 0) + lm_grad),
                                activations=kept_fwd - head_saved + grad_x))
    else:
        where.append(("loss", 0))
        # (the vocabulary-parallel cross-entropy's backward makes one logits-sized gradient, not two: traced with
        # PyTorch's loss_parallel)
        ce_grads = 1 if setup.parallel.loss_parallel else 2
        moments.append(_objects(**base_bwd, activations=kept_fwd + lsm, temporaries=ce_grads * t * v * 4))
    # (B) LM-head backward: logits gradient, hidden-state gradient, the weight gradient appears.
    # (the 16-bit weight gradient beside the fp32 one autocast makes of it; FSDP2's policy makes only the 16-bit one,
    # which fsdp2_ledger counts as the unit's unsharded gradient when not accumulating: traced)
    lm_tmp = t * v * d.matmul + (0 if head_only else t * h * d.matmul) + \
        (v * h * d.matmul if d.matmul != p and head_trains and not (fsdp2 and not accumulating) else 0)
    # (the chunked loss made the head's gradients in forward: no head backward)
    if not chunked and lm_copy and d.matmul != p and head_trains:
        # Under autocast the head's matmul backward (16-bit weight copy alive, no fp32 gradient yet) and the cast
        # of its 16-bit weight gradient to fp32 (copy released, both gradients alive) are two moments. The fp32
        # gradient becomes .grad, or with accumulation is a temporary added into the existing .grad.
        where.append(("head", 0))
        moments.append(_objects(parameters=params + copies_bwd, optimizer_state=state, inputs=inputs,
                                gradients=grads_all if accumulating else 0, activations=kept_fwd,
                                temporaries=lm_tmp))
        where.append(("head", 0))
        moments.append(_objects(parameters=params + copies_bwd - lm_copy, optimizer_state=state, inputs=inputs,
                                gradients=grads_all if accumulating else lm_grad, activations=kept_fwd,
                                temporaries=t * h * d.matmul + v * h * d.matmul + (lm_grad if accumulating else 0)))
    elif not chunked:
        where.append(("head", 0))
        moments.append(_objects(
            parameters=params + copies_bwd, optimizer_state=state, inputs=inputs,
            gradients=grads_all if accumulating else lm_grad,
            # (accumulating, the fp32 gradient to add into .grad; FSDP2 over a whole model makes only the 16-bit one,
            # the root's unsharded gradient, where the policy computes in 16 bits: traced)
            activations=kept_fwd,
            temporaries=lm_tmp + (lm_grad if accumulating and not (fsdp2_whole and d.matmul != p) else 0),
        ))
    if not spec.stage_last:  # a pipeline stage before the last: its backward starts at its top layer
        moments.clear()
        where.clear()
    # (C) decoder layers: the first processed (the last layer) and the last processed (the first), each
    # at its MLP backward (three I-wide gradients beside the residual-stream gradient) and at its
    # attention backward (score gradients for eager, q/k/v gradients for SDPA).
    g_layer = spec.layer_params * p
    g_down = h * spec.intermediate_size * p
    g_mlp = spec.mlp_params * p
    g_out = h * spec.q_dim * p  # the output projection's weight gradient, first of the attention backward
    head_grads = v * h * p + (h * (2 if spec.norm_bias else 1)) * p if spec.stage_last else 0
    if tuned:
        g_layer, g_down, g_mlp = tp.layer_grads, tp.down_grads, tp.mlp_grads
        g_out = 0 if not tp.layers_trained else g_out
        head_grads = lm_grad
    grad_stream = t * h * 4 if d.autocast or d.residual == 4 else t * h * 2
    tI = t * spec.intermediate_size * d.matmul
    stream_kept = stream if keep_stream else 0
    mlp_out = tI  # act·up (or act(x)) freed once the down projection's backward has run
    if "mlp.down_lora" in per_layer:
        mlp_out = per_layer["mlp.down_lora"]  # a frozen down projection kept no input; its adapter may
    n_mlp_grads = 3 if spec.gated_mlp or mlp_saved(spec, d, t)["mlp"] >= 5 * tI else 2
    scores = b * spec.num_heads * seq * seq
    if setup.attention == "eager":
        attn_tmp = t * spec.q_dim * d.matmul + scores * (d.matmul + 4)
    elif setup.attention == "flash":
        attn_tmp = flash_backward_bytes(spec, d, t, setup.batch)
    else:
        attn_tmp = t * spec.q_dim * d.matmul + t * (spec.q_dim + 2 * spec.kv_dim) * d.matmul
    layer_norm_params = spec.norms_per_layer * h * (2 if spec.norm_bias else 1)
    layer_copy_w = (spec.layer_params - layer_norm_params) * 2 if d.autocast else 0
    down_copy = h * spec.intermediate_size * 2 if d.autocast else 0
    mlp_copy = spec.mlp_params * 2 if d.autocast else 0
    bottom = 1
    if tuned:
        if tp.layers_trained:
            bottom = n_layers - tp.layers_trained + 1  # the backward stops at the lowest trained layer
        layer_copy_w = (copies - lm_copy) // n_layers if d.autocast or d.adapters_autocast else 0
        if setup.tuning.method == "qlora":
            down_copy = mlp_copy = 0  # 4-bit weights are dequantized into transients, not cached
    # every term of a layer's moment is linear in k (FSDP2's sharded gradients too): the first and the last layer
    # processed bound them all
    # FSDP2's kept reduce-scatter buffer is there for the layers between the top and the bottom one: those nearest
    # each end bound them
    ks = (n_layers, bottom) if not fsdp2 else tuple(sorted({k for k in (n_layers, n_layers - 1, bottom + 1, bottom)
                                                            if bottom <= k <= n_layers}, reverse=True))
    for k in () if head_only else ks:
        done = n_layers - k
        below = k - bottom  # layers under this one that keep activations
        if ckpt:
            # offloaded: only this layer's input, copied back (torchtune prefetches the next one on a GPU stream)
            earlier = k * stream + (k - 1) * sac if offload == "none" else \
                stream * (2 if offload == "checkpoint-inputs" and setup.target_device == "cuda" and k > bottom else 1)
            earlier += sdpa_mask_bytes(spec, setup)
        elif tuned and not tp.layers_trained:
            earlier = (first_layer + (below - 1) * s_layer) if below else 0
        elif n_ck:  # the layers below keep their input or what they save; a checkpointed one keeps its own input
            earlier = sum(stream if checkpointed(j) else s_layer for j in range(bottom, k)) + \
                (stream if checkpointed(k) else stream_kept) + sdpa_mask_bytes(spec, setup)
        else:
            earlier = stream_kept + below * s_layer
        current = (first_layer if tuned and not tp.layers_trained and k == 1 else s_layer) - stream_kept
        copies_before = 0 if ckpt else sum(0 if checkpointed(j) else layer_copy_w for j in range(1, k))
        grads_before = grads_all if accumulating else head_grads + done * g_layer
        acc_tmp_mlp = g_down if accumulating else 0
        if offload == "all" and not ckpt:
            # every saved tensor comes back as its own backward node runs and dies with it; the rotary tables and the
            # 16-bit weight copies exist only on the host. MLP: the gradient of the gate·up product beside the two
            # operands copied back and their two gradients (one operand and its gradient for a plain MLP);
            # attention: what it saved, copied back, beside its gradients
            unpacked = (2 if spec.gated_mlp else 4 if wide == 4 else 1) * tI  # the tanh GELU's products save 4
            where.append(("mlp", k))
            moments.append(_objects(
                parameters=params, optimizer_state=state, inputs=inputs,
                gradients=grads_before + (0 if accumulating else g_down),
                temporaries=grad_stream + n_mlp_grads * tI + unpacked + acc_tmp_mlp + dequant))
            where.append(("attn", k))
            moments.append(_objects(
                parameters=params, optimizer_state=state, inputs=inputs,
                gradients=grads_before + (0 if accumulating else g_mlp + g_out),
                temporaries=grad_stream + attn_tmp + attn_part + (g_out if accumulating else 0) + dequant))
            continue
        if fsdp2:  # the layer's all-gather copied out as its backward (or recomputation) starts
            where.append(("gather", k))
            moments.append(_objects(parameters=params, optimizer_state=state, inputs=inputs, gradients=grads_before,
                                    activations=earlier + (0 if ckpt else current) + rope_tables,
                                    temporaries=grad_stream))
        # MLP moment. Accumulating, the down projection's weight gradient is a temporary added into .grad before the
        # product's backward makes its two I-wide gradients: that moment (act·up still alive, its gradient and the
        # weight gradient) and the next (three I-wide gradients, the weight gradient already added) are apart
        # (traced on pipeline stages, whose backward peaks in their top layer; single-GPU peaks at the head move
        # by 0.4 % at most). FSDP2 over a whole model reduce-scatters each micro-batch's gradients, so its unsharded
        # parameters keep the weight gradient beside the three; a pipeline stage's backward adds it into the unsharded
        # accumulator, as a single GPU does (``backward_maybe_with_nosync``; both traced)
        if accumulating and not fsdp2_whole:
            where.append(("mlp", k))
            moments.append(_objects(
                parameters=params + copies_before + layer_copy_w, optimizer_state=state, inputs=inputs,
                gradients=grads_before, activations=earlier + current + rope_tables,
                temporaries=grad_stream + tI + acc_tmp_mlp + dequant))
        where.append(("mlp", k))
        moments.append(_objects(
            parameters=params + copies_before + layer_copy_w - down_copy, optimizer_state=state,
            inputs=inputs,
            gradients=grads_before + (0 if accumulating else g_down),
            activations=earlier + current - mlp_out + rope_tables,
            # (FSDP2's weight gradient at work has the gathered weights' dtype: bf16 under its mixed policy; traced)
            temporaries=grad_stream + n_mlp_grads * tI + (acc_tmp_mlp * d.matmul // p if fsdp2_whole else 0) + dequant,
        ))
        if spec.norm == "rmsnorm" and spec.family not in GEMMA_NORM:
            # the second norm's backward (the MLP done): autograd's RMSNorm keeps five fp32 stream-sized tensors at
            # once (the gradient through the rsqrt, the mean's expanded gradient, and pow's three), beside its fp32
            # input; a 16-bit stream's gradient is another tensor beside them, an fp32 one is summed into the first.
            # A narrow MLP (a tensor-parallel rank's I/tp) makes this the layer's peak (traced). Sequence parallelism
            # runs the norm on the rank's share of the tokens
            norm32 = -(-t * h * 4 // sp)
            where.append(("attn", k))
            moments.append(_objects(
                parameters=params + copies_before + layer_copy_w - mlp_copy, optimizer_state=state, inputs=inputs,
                gradients=grads_before + (0 if accumulating else g_mlp),
                activations=earlier + attn_part + norm32 + rope_tables,
                temporaries=(grad_stream if d.residual != 4 else 0) + 5 * norm32 + dequant,
            ))
        # attention moment (the MLP of this layer is done)
        where.append(("attn", k))
        moments.append(_objects(
            parameters=params + copies_before + layer_copy_w - mlp_copy, optimizer_state=state, inputs=inputs,
            gradients=grads_before + (0 if accumulating else g_mlp + g_out),
            activations=earlier + attn_part + rope_tables,
            temporaries=grad_stream + attn_tmp + (g_out if accumulating else 0) + dequant,
        ))
    # (D) embedding backward: every gradient exists. Tied embeddings: the LM head's weight gradient waits in
    # autograd's input buffer while the embedding's dense gradient is made, then the two are summed; without
    # accumulation that sum becomes .grad, with accumulation it is a third temporary added into .grad.
    # (FSDP2 over a whole model reduce-scatters every micro-batch: the sum becomes the root's unsharded gradient, as
    # without accumulation, not a temporary added into it; fsdp2_ledger counts that gradient: traced)
    added = accumulating and not fsdp2_whole
    # a vocabulary split by PyTorch's plan in a pipeline stage under FSDP2: DTensor's embedding backward makes the
    # gradient of the whole vocabulary, replicated over the tensor-parallel ranks (traced, with sequence parallelism
    # and without: core.pipeline.whole_vocabulary_gradient)
    replicated = setup.parallel.tp if fsdp2 and not fsdp2_whole and setup.parallel.loss_parallel and \
        spec.stage_first and not spec.tied_embeddings else 1
    if not spec.stage_first:
        emb_tmp = grad_stream  # a later pipeline stage: the gradient of its input, to be sent to the stage before
    elif tuned and not tp.embeddings_trainable:
        emb_tmp = 0  # frozen embeddings: the backward ends in the lowest trained layer
    elif spec.tied_embeddings:
        # (autograd's gradients have the weights' dtype as the step computes: bf16 under FSDP2's mixed-precision
        # policy and Megatron-LM's bf16 model, whose fp32 gradients are the strategy's)
        emb_tmp = grad_stream + (3 if added else 2) * v * h * d.param
    else:
        emb_tmp = grad_stream + (v * replicated * h * d.param if added else 0)
    where.append(("embedding", n_layers))
    moments.append(_objects(parameters=params, optimizer_state=state, inputs=inputs, gradients=grads_all,
                            temporaries=emb_tmp))
    # ---- optimizer step ---------------------------------------------------------------------
    step = _objects(parameters=params, gradients=grads_all, optimizer_state=state, inputs=inputs,
                    optimizer_temporaries=opt.step_temporary_bytes)
    if setup.optimizer_in_backward:
        # each parameter is stepped as its gradient is accumulated, and the gradient freed: no gradients pile up,
        # the largest step (the LM head's, or the embedding's) runs inside backward, and the optimizer phase keeps
        # the weights and the state only
        big = max((r * c for r, c in layout[0] + layout[1] + layout[2]), default=0)
        one = optimizer_cost(setup.optimizer, setup.optimizer_impl, ([], [], [(big, 1)]), 1,
                             tp.grad_bytes if tuned else p, paging=setup.target_device == "cuda")
        # a tied head's gradient waits in autograd's input buffer for the embedding's (one accumulation, one step at
        # the end); the last moment, the embedding backward, already counts it among its temporaries
        waiting = lm_grad if spec.tied_embeddings and head_trains else 0
        moments = [dict(m, gradients=min(m.get("gradients", 0), waiting) if i < len(moments) - 1 else 0)
                   for i, m in enumerate(moments)]
        if head_trains and not head_only and not spec.tied_embeddings:
            # the head's own step: its gradient and the hidden states' beside the activations
            head_acts = acts_fwd - head_saved + grad_x if chunked else acts_fwd
            moments.append(_objects(parameters=params + copies_bwd, optimizer_state=state, inputs=inputs,
                                    activations=head_acts, temporaries=0 if chunked else t * h * d.matmul,
                                    gradients=lm_grad, optimizer_temporaries=one.step_temporary_bytes))
        moments.append(_objects(parameters=params, optimizer_state=state, inputs=inputs,
                                gradients=big * (tp.grad_bytes if tuned else p),
                                optimizer_temporaries=one.step_temporary_bytes))
        step = _objects(parameters=params, optimizer_state=state, inputs=inputs)
    load = {"parameters": params}
    notes: tuple[str, ...] = ()
    forward_moments: list[tuple[str, dict[str, int]]] = []  # FSDP2 fills it
    host_bytes = offload_host
    par = setup.parallel
    if par.is_distributed and par.strategy == "ddp" and tuned and par.ep == 1:
        # DDP buckets only the gradients of parameters that require them: LoRA's adapters, the unfrozen parts. The
        # frozen (or 4-bit) base stays as the single-GPU ledger has it.
        for m in (forward, *moments, step):
            m["gradients"] = m.get("gradients", 0) + grads_all
        notes = ("DDP keeps every trainable gradient once more in its communication buckets "
                 "(gradient_as_bucket_view=False, the default); the frozen base has none",)
    elif par.is_distributed:
        states = states_for(spec, setup, state + paged, opt.step_temporary_bytes, copies)
        if par.strategy == "fsdp2" and par.ep == 1:
            load, forward, moments, step = fsdp2_ledger(spec, setup, states, fwd_candidates, moments, where, step, p,
                                                        collect=forward_moments, fresh=(head_grads, g_mlp))
        else:
            load, forward, moments, step = per_gpu_ledger(states, par, load, forward, moments, step)
        notes, host_bytes = states.notes, states.host_bytes + offload_host
        if paged:  # the strategy splits the whole state; the paged share stays paged
            per_gpu = forward.get("optimizer_state", 0)
            paged = per_gpu * paged // (state + paged)
            for m in (forward, *moments, step):
                m["optimizer_state"] = per_gpu - paged
    if paged:
        for m in (forward, *moments, step):
            m["paged_optimizer_state"] = paged
    backward = max(moments, key=lambda m: sum(m.values()))

    phases = {
        "load": with_overheads(load, "load", setup),
        "forward": with_overheads(forward, "forward", setup),
        "backward": with_overheads(backward, "backward", setup),
        "optimizer_step": with_overheads(step, "optimizer_step", setup),
    }
    assumptions = _assumptions(spec, setup, opt.note) + notes
    details = {
        "host_bytes": host_bytes,
        "offloaded_activation_bytes": offload_host,
        "activations_per_layer_bytes": s_layer,
        "activations_per_layer": per_layer,
        "saved_activations_bytes": acts_fwd,
        "stream_kept_bytes": stream if keep_stream else 0,
        "logits_bytes": logits,
        "compute_copy_bytes": copies,
        "lm_head_copy_bytes": lm_copy,
        # the autocast weight copies matmuls save for backward (a pipeline keeps one set per micro-batch in flight)
        "saved_copy_bytes": copies_bwd if d.autocast else 0,
        "parallel_notes": notes,  # why a per-GPU number moves with the strategy (the window's banner says it)
        # FSDP2's moments, each (core.pipeline holds every unit gathered in a pipeline's steady state)
        "forward_moments": forward_moments,
        "backward_moments": moments if forward_moments else [],
        "parameter_split": parameter_split(spec, setup, params) if tuned else {},
    }
    return Estimate(setup=setup, method="analytic", phases=phases, assumptions=assumptions, details=details)


def states_for(spec: ModelSpec, setup: TrainingSetup, state_bytes: int, step_temporaries: int,
               copies: int) -> ModelStates:
    """The strategy's per-GPU model states for this architecture (see ``distributed.model_states``)."""
    par = setup.parallel
    if par.etp > 1:
        raise InputError("etp", f"{spec.name} has no routed experts to split (expert tensor parallelism needs a "
                                "mixture of experts)")
    if par.ep > 1:
        raise InputError("ep", f"{spec.name} has no routed experts to split (expert parallelism needs a mixture of "
                               "experts)")
    unit = spec.largest_module_params if par.strategy == "zero3" else spec.layer_params
    return model_states(par, spec.num_params, unit, setup.precision, state_bytes, step_temporaries, copies,
                        spec.root_unit_params)


def per_gpu_ledger(
    states: ModelStates, par: Parallelism, load: dict[str, int], forward: dict[str, int],
    moments: list[dict[str, int]], step: dict[str, int],
) -> tuple[dict[str, int], dict[str, int], list[dict[str, int]], dict[str, int]]:
    """Replace the model-state objects of the single-GPU ledger by the strategy's per-GPU ones.

    DDP replicates the model, so the single-GPU moments stay (gradients appear layer by layer) and its
    buckets are added; the sharded strategies hold their partitions and gathered units throughout.
    """
    def replace(m: dict[str, int], phase: str) -> dict[str, int]:
        out = dict(m)
        if par.strategy == "ddp":
            out["gradients"] = out.get("gradients", 0) + states.gradients[phase] - (
                states.gradients["backward"] - states.gradients["forward"] if phase == "backward" else 0)
        else:
            out["parameters"] = states.parameters[phase]
            out["gradients"] = states.gradients[phase]
        out["optimizer_state"] = states.optimizer_state
        if phase == "optimizer_step":
            out["optimizer_temporaries"] = states.optimizer_temporaries
            out["gradients"] = states.gradients[phase]
            out["parameters"] = states.parameters[phase]
        return _objects(**out)

    if par.strategy == "ddp":
        load = _objects(**dict(load, gradients=load.get("gradients", 0) + states.gradients["load"]))
    else:
        load = _objects(parameters=states.parameters["load"], gradients=states.gradients["load"])
    return (load, replace(forward, "forward"), [replace(m, "backward") for m in moments],
            replace(step, "optimizer_step"))


def fsdp2_ledger(
    spec: ModelSpec, setup: TrainingSetup, states: ModelStates, fwd_candidates: list[tuple[str, dict[str, int]]],
    moments: list[dict[str, int]], where: list[tuple[str, int]], step: dict[str, int], p: int,
    collect: list[tuple[str, dict[str, int]]] | None = None, fresh: tuple[int, int] = (0, 0),
) -> tuple[dict[str, int], dict[str, int], list[dict[str, int]], dict[str, int]]:
    """The per-GPU ledger under FSDP2, moment by moment (checked against real 2- and 4-process gloo steps,
    ``tests/test_fsdp2.py``).

    Each GPU keeps its parameter shard and the root unit (embeddings, final norm, head: not resharded after forward)
    gathered throughout, plus the last all-gather's output, which FSDP2 keeps until the next all-gather (instead of
    ``record_stream``); a decoder layer is gathered while its forward or backward runs (every layer from its forward
    to its backward without ``reshard_after_forward``). Gradients: a finished layer's are reduce-scattered into its
    shard; the root unit's stay unsharded until the end of backward; the running layer's are unsharded, in the
    gathered dtype. Without resharding the backward gathers nothing, and the last forward all-gather's output is gone
    by then. ``p`` is the single-GPU ledger's gradient element size; ``fresh`` the head's and a layer's MLP gradients
    in it (what an accumulating step holds unsharded beside its sharded accumulators).
    """
    par = setup.parallel
    n, nl = par.shards, spec.num_layers
    big = spec.layer_params
    w = 4 if setup.precision == "fp32" else 2  # gathered weights and unsharded gradients
    shard = 2 if setup.precision in ("bf16", "bf16-autocast") else 4  # sharded weights and gradients
    rs = 4 if setup.precision == "mixed" else w  # reduce-scatter buffers: reduce_dtype fp32 under mixed precision
    # A pipeline stage's embedding and its final norm with the head are units of their own (torchtitan's), which
    # reshard after forward like the layers: each is gathered at its own forward and backward only. The stage is the
    # root, so its forward's end frees the last all-gather output (``FSDPState._post_forward``), and the schedule
    # computes the loss after that, with nothing gathered. A whole model's root unit holds them and is never
    # resharded after forward.
    # A pipeline stage runs its backwards without resharding or reduce-scattering (core.pipeline): a unit gathered by
    # the backward stays gathered, and no reduce-scatter input is held.
    pipelined = not (spec.stage_first and spec.stage_last)
    own_root = par.reshard_after_forward and pipelined
    root_w = spec.root_unit_params * w
    base = states.parameters["optimizer_step"] + (0 if own_root else root_w) + big * w
    accumulating = setup.grad_accum > 1
    all_shards = states.gradients["optimizer_step"]

    def objects(m: dict[str, int], gathered_layers: int, grads: int) -> dict[str, int]:
        return _objects(**dict(m, parameters=base + gathered_layers * big * w, gradients=grads,
                               optimizer_state=states.optimizer_state))

    keep_all = 0 if par.reshard_after_forward else nl  # layers kept gathered from forward to backward
    # kept gathered, recomputing the top checkpointed layer casts one more gathered copy under mixed precision
    # (measured on real 2- and 4-process steps); resharded, the recomputation's all-gather is the layer's own
    recompute = setup.checkpointing != "none" and keep_all > 0 and setup.precision == "mixed"

    def gathered_in_forward(at: str) -> int:
        if at == "gather":  # the new all-gather output and the unsharded parameters it is copied into
            return max(keep_all - 1, 0) + 2
        if at == "gather-first":
            return 2
        # (a stage before the last ends in its last layer, still gathered beside its all-gather output)
        at_work = ("layer", "attention", "layer-first") + (("loss",) if pipelined and not spec.stage_last else ())
        return max(keep_all, 1 if at in at_work else 0)

    def in_forward(at: str, m: dict[str, int]) -> dict[str, int]:
        out = objects(m, gathered_in_forward(at), all_shards if accumulating else 0)
        if at == "gather-first":  # the kept all-gather output is the root unit's, not a layer's
            out["parameters"] += (spec.root_unit_params - big) * w
        if own_root and at in ("head", "embedding"):  # the unit gathered, its all-gather output the one kept
            out["parameters"] += 2 * root_w - big * w
        if own_root and at == "loss" and spec.stage_last:
            out["parameters"] -= big * w
        return out

    every = [in_forward(at, m) for at, m in fwd_candidates]
    # the backward prefetches the next unit down (FSDP2's default): layer k's copy-out is followed by the all-gather
    # of layer k − 1, or on the first stage of the embedding's unit, bigger than a layer; that all-gather frees the
    # last output (layer k's) and, under the mixed-precision policy, first casts the unit's shard into a bf16 input
    # buffer that lives until the output is allocated (``foreach_all_gather``; traced)
    cast_w = 2 if setup.precision == "mixed" else 0

    def prefetched(at: str, k: int) -> int:
        below = big if k > 1 else spec.root_unit_params if own_root and spec.stage_first else 0
        if not below:
            return 0
        if at == "gather":  # the larger of the copy-out (layer k's output kept) and the prefetch
            return max(0, below * w - big * w + -(-below // n) * cast_w)
        # while a layer computes, the output held is the prefetched one: layer k − 1's (the slot in ``base``) or the
        # embedding's, beside the bottom layer, whose own output is freed after its copy-out (traced)
        return below * w if k == 1 else 0
    if collect is not None:  # each forward moment, named (a pipeline stage re-weighs them: core.pipeline)
        collect.extend(zip((at for at, _ in fwd_candidates), every, strict=True))
    forward = max(every, key=lambda m: sum(m.values()))
    out = []
    for m, (at, k) in zip(moments, where, strict=True):
        single = m.get("gradients", 0)
        if at == "gather" and keep_all:
            continue  # kept gathered: the backward gathers nothing
        if at in ("mlp", "attn", "gather"):
            done = nl - k
            # the single-GPU moment's gradients: the head's and the finished layers' (p bytes) and this layer's
            # (in a pipeline stage the head's gradients went into its own accumulator, counted by core.pipeline)
            head = spec.root_unit_params * p if pipelined and spec.stage_last else 0
            if accumulating and not pipelined:
                # each micro-batch's backward reduce-scatters (torchtitan's accumulation): the root unit's gradients
                # (the head's, made first) stay unsharded until the root's reduce-scatter ends the backward, a
                # layer's until its own, and the weight gradient at work is among the temporaries (traced)
                unsharded = (fresh[0] + (fresh[1] if at == "attn" else 0)) * w // p
            else:
                unsharded = 0 if accumulating else max(0, single - done * big * p - head) * w // p
            sharded = all_shards if accumulating else 0 if pipelined else -(-done * big * shard // n)
            gathered = 1 if at == "gather" else (k if keep_all else 1) + (1 if recompute and k == nl else 0)
            if pipelined:  # this layer, the ones above it, and the next one's prefetch (the kept slot in ``base``)
                gathered = (nl if keep_all else nl - k + 1 if at == "gather" else min(nl - k + 1, nl - 1)) \
                    + (1 if recompute and k == nl else 0)
        elif at == "embedding":
            unsharded = spec.root_unit_params * w
            sharded = all_shards if accumulating else 0 if pipelined else -(-nl * big * shard // n)
            gathered = nl - (0 if keep_all else 1) if pipelined else 0
        else:  # the loss and the head: no layer finished yet
            unsharded = 0 if accumulating else single * w // p
            sharded = all_shards if accumulating else 0
            gathered = keep_all
        moment = objects(m, gathered, unsharded + sharded)
        bottom = at in ("mlp", "attn") and k == 1 < nl
        if not pipelined and (at == "embedding" or bottom):
            # the last reduce-scatter's input (the layer above's in the bottom layer's backward, the bottom layer's at
            # the embedding) is kept until the next reduce-scatter (``reduce_scatter_states``), and no all-gather
            # output is, none being prefetched (traced: the two weigh the same but under mixed precision, where the
            # input is fp32; a tied model peaks at the embedding)
            moment["temporaries"] += big * rs
            moment["parameters"] -= 0 if keep_all else big * w
        elif not pipelined and nl == 1 and at in ("mlp", "attn") and not keep_all:
            # a whole model's only layer: its backward's all-gather output is freed at the copy-out (FSDP2 keeps the
            # output only in forward, for the next all-gather to wait on), nothing below is prefetched (the root unit
            # is gathered throughout) and no layer above was reduce-scattered (traced: 4-14 % over when the layer
            # kept an output)
            moment["parameters"] -= big * w
        elif not pipelined and ((at == "gather" and k < nl) or (at in ("mlp", "attn") and 1 < k < nl)):
            # a layer above was reduce-scattered: FSDP2 keeps the last reduce-scatter's input (in the reduce dtype,
            # fp32 under mixed precision) as the next layer's all-gather is copied out, and through the backward of
            # the layers above the bottom one, beside the prefetched layer's all-gather output (measured on
            # fake-process-group traces, which equal real gloo steps)
            moment["temporaries"] += big * rs
        if keep_all:  # no all-gather in backward: the forward's last output is gone
            moment["parameters"] -= big * w
        if own_root:
            # nothing gathered yet at the loss's backward; the head gathered from its backward on (a pipeline stage
            # runs its backwards without resharding: core.pipeline), the embedding at its own
            moment["parameters"] += -big * w if at == "loss" else root_w if spec.stage_last or at == "embedding" \
                else 0
        if pipelined and not keep_all and at in ("mlp", "attn", "gather"):
            moment["parameters"] += prefetched(at, k)
        out.append(moment)
    # the root unit's reduce-scatter ends the backward, in two moments: its input in the reduce dtype is copied from
    # the root's unsharded gradients (both alive), which are then freed, and its output shard is made; the layers'
    # gradient shards beside both, the root's weights resharded by then (traced). Under mixed precision the root's
    # last parameter's bf16 gradient (in the order the model registers them: the head's bias, else its weight, else,
    # the head tied, the final norm's) is freed only after the output is made (traced: Llama, Qwen3 and GPT-NeoX
    # keep the head's weight gradient there, Phi its bias's). A pipeline stage reduce-scatters after its last
    # backward instead, every unit at once (core.pipeline)
    root = spec.root_unit_params
    layer_shards = all_shards if accumulating else -(-nl * big * shard // n)
    last = spec.vocab_size if spec.lm_head_bias else spec.hidden_size if spec.tied_embeddings \
        else spec.vocab_size * spec.hidden_size
    late_grad = last * w if setup.precision == "mixed" else 0
    if not pipelined:
        ends = _objects(parameters=states.parameters["optimizer_step"], optimizer_state=states.optimizer_state,
                        inputs=step.get("inputs", 0), gradients=layer_shards, temporaries=root * rs)
        out.append(dict(ends, temporaries=root * rs + root * w))
        out.append(dict(ends, gradients=layer_shards + -(-root * rs // n), temporaries=root * rs + late_grad))
    step = _objects(**dict(step, parameters=states.parameters["optimizer_step"], gradients=all_shards,
                           optimizer_state=states.optimizer_state,
                           optimizer_temporaries=states.optimizer_temporaries))
    return {"parameters": states.parameters["load"]}, forward, out, step


def _tuning_assumptions(spec: ModelSpec, setup: TrainingSetup) -> list[str]:
    ft = setup.tuning
    if ft.method == "full":
        return []
    rows = [setup.tuning_text()]
    if ft.uses_adapters:
        masks = "as bool on CUDA" if setup.target_device == "cuda" else "in the input dtype on CPU"
        rows.append(f"LoRA (peft LoraLayer): frozen base linears keep no inputs; each adapted module keeps its own "
                    f"input (cast to the {ft.adapter_dtype} adapters, or to 16 bits under autocast) and lora_A's "
                    f"r-wide output" + (f"; dropout {ft.dropout:g} keeps a copy and a mask ({masks}) per module"
                                        if ft.dropout > 0 else ""))
    if ft.method == "qlora":
        rows.append("QLoRA (bitsandbytes via transformers' BitsAndBytesConfig): every decoder-layer linear quantized; "
                    + ("embeddings, norms and the output head in fp32 (peft's prepare_model_for_kbit_training); "
                       if ft.prepare_kbit else "embeddings, norms and the output head in the precision's dtype "
                       "(no prepare_model_for_kbit_training); ") + "a 4-bit "
                    "weight is dequantized into a transient in forward and again in backward (the largest one is "
                    "counted), never kept; its output has its input's dtype (fp32 under autocast)")
    if ft.method == "frozen":
        rows.append("Frozen parts: gradients and optimizer state for the trained parts only; layers below the "
                    "lowest trained part keep no activations (no gradient reaches them)")
    return rows


def _assumptions(spec: ModelSpec, setup: TrainingSetup, opt_note: str) -> tuple[str, ...]:
    accum = f"; kept across the {setup.grad_accum} accumulation micro-batches" if setup.grad_accum > 1 else ""
    rows = [
        f"Steady-state iteration (optimizer state exists; gradients freed by zero_grad(set_to_none=True){accum})",
        f"{spec.family} block counted tensor by tensor ({setup.attention} attention, "
        f"{CHECKPOINT_WORDS.get(setup.checkpointing) or _every_words(setup.checkpointing)})",
        {"fp32": "fp32: 4 B/param weights, gradients and activations",
         "mixed": "Mixed precision (bf16/fp16 autocast): fp32 weights + 16-bit copies of matmul weights "
                  "(6 B/param, Transformers docs), fp32 gradients; norms, softmax, residual stream and loss stay fp32",
         "bf16": "bf16: 2 B/param weights, gradients and optimizer state; norms upcast to fp32 inside",
         "bf16-autocast": "bf16 weights under bf16 autocast: 2 B/param weights, gradients and optimizer state, as "
                          "bf16 (autocast leaves bf16 weights alone); fp32 adapters get autocast's 16-bit copies",
         }[setup.precision],
        opt_note + (f" ({setup.optimizer_impl} step)" if setup.optimizer != "galore-adamw" else ""),
        ("Loss: chunked fused linear cross-entropy (Liger-Kernel's LigerFusedLinearCrossEntropyLoss), "
         f"{setup.loss_chunk or liger_chunk_rows(setup.tokens, spec.hidden_size, spec.vocab_size):,} "
         "tokens per chunk: the hidden-state and head-weight gradients are made in forward, the full logits never "
         "exist" + ("; the CPU ledger models memcalc's torch version of it" if setup.target_device == "cpu" else "")
         if setup.loss == "chunked" else
         "Loss: Hugging Face causal-LM loss (fp32 logits copy, log-softmax kept for backward)"),
        ("use_cache=True: transformers' DynamicCache copies every layer's k and v during forward (the loop keeps "
         "the config's default)" + ("; with gradient checkpointing transformers passes the layers no cache, so "
                                     "nothing changes" if setup.checkpointing == "full" else "")
         if setup.use_cache else
         "use_cache=False, as transformers' Trainer passes it in training (a loop that keeps the config's "
         "use_cache=True holds k/v copies in forward: choose it to see them)"),
        *_tuning_assumptions(spec, setup),
        *([_vocabulary_words(setup)] if setup.parallel.tp > 1 else []),
        *([f"Padding-free packing (DataCollatorWithFlattening): {setup.packing_text()}, position_ids restarting at "
           "each document; " + PACKING_WORDS[setup.attention]] if setup.packing else []),
        *_sliding_assumptions(spec, setup),
        *([OFFLOAD_WORDS[setup.activation_offload] + (
            "; on a GPU the next layer's input is prefetched while this one runs (one more in flight)"
            if setup.activation_offload == "checkpoint-inputs" and setup.target_device == "cuda" else "")]
          if setup.activation_offload != "none" else []),
        f"CUDA context {setup.cuda_context_bytes / 2**20:.0f} MiB; allocator reserve "
        f"{setup.allocator_reserve:.0%} of tensor bytes (memory-profiling guide: fragmentation 5–20 %)",
    ]
    return tuple(rows)


def _sliding_assumptions(spec: ModelSpec, setup: TrainingSetup) -> list[str]:
    """What a sliding attention window (Mistral, Phi-3, Qwen2/3 with ``use_sliding_window``) does to the step."""
    if not spec.sliding_window or not spec.sliding_layers:
        return []
    which = "every layer" if spec.sliding_layers >= spec.num_layers else \
        f"{spec.sliding_layers} of {spec.num_layers} layers (counted in every layer: an upper bound)"
    window = f"Sliding attention window of {spec.sliding_window:,} tokens in {which}"
    if setup.attention != "sdpa" or setup.packing:
        return [window]
    if setup.row_len < spec.sliding_window:
        return [f"{window}: the sequence is shorter, so transformers passes SDPA no mask (is_causal)"]
    return [f"{window}: from that many tokens on transformers passes SDPA an explicit mask (bool, rows × L × L), "
            "which every layer keeps as an additive copy in q's dtype for backward, and repeats grouped k/v heads "
            "(no enable_gqa with a mask); flash attention keeps neither"]


def _vocabulary_words(setup: TrainingSetup) -> str:
    """Where a tensor-parallel rank's embedding and head are: split by vocabulary (Megatron-LM always, torchtitan's
    FSDP2 by default, or as asked) or whole (transformers' plans)."""
    par = setup.parallel
    if not par.loss_parallel:
        return (f"Embedding and head whole on each of the {par.tp} tensor-parallel GPUs, as transformers' plans keep "
                "them, the logits and the loss over the whole vocabulary (loss parallelism would split them)")
    why = ("Megatron-LM always splits it: VocabParallelEmbedding, a column-parallel output layer and "
           "vocab_parallel_cross_entropy" if par.strategy in VOCAB_SPLIT_ALWAYS else
           "loss parallelism, torchtitan's default beside FSDP2" if par.strategy == "fsdp2" else "loss parallelism")
    return (f"Vocabulary split over the {par.tp} tensor-parallel GPUs ({why}): each holds 1/{par.tp} of the "
            "embedding's rows, the head's columns and the logits")


PACKING_WORDS = {
    "flash": "FlashAttention-2's variable-length kernel attends within each document and keeps no mask",
    "sdpa": "transformers builds a block-diagonal bool mask (rows × L × L) and SDPA saves it, converted to q's dtype, "
            "in every layer, with grouped k/v heads repeated: choose flash attention to avoid both",
    "eager": "eager attention computes every row's L × L scores and masks them",
}

OFFLOAD_WORDS = {
    "checkpoint-inputs": "Activation offloading of the decoder body (torchtune's OffloadActivations): tensors it saves "
                         "of 1 KiB or more, parameters apart, live in host memory (with checkpointing: each layer's "
                         "input) and come back when backward needs them; the head and the loss keep theirs",
    "all": "Activation offloading of the decoder body (torch.autograd.graph.save_on_cpu): every tensor it saves, "
           "weights included, is copied to host memory (once per op that saves it) and back as its backward node "
           "runs; the head and the loss keep theirs; host bytes count the copies",
}
CHECKPOINT_WORDS = {"full": "full gradient checkpointing", "none": "no checkpointing",
                    "selective": "per-op selective checkpointing of every layer (torchtitan's op policy: each layer "
                                 "keeps its input, every other matrix product's output and the attention output)"}


def _every_words(checkpointing: str) -> str:
    return f"every {ordinal(int(checkpointing[6:]))} layer checkpointed (torchtitan's selective layer checkpointing)"


def parameter_split(spec: ModelSpec, setup: TrainingSetup, params: int) -> dict[str, int]:
    """The parameters object of a fine-tuning run split by role: the frozen base (quantized part apart) and what
    trains — what the window's ledger tooltip and the report list."""
    ft = setup.tuning
    p = Dtypes.of(setup).param
    a_bytes = 2 if ft.adapter_dtype == "bf16" else 4
    if ft.uses_adapters:
        adapters = ft.adapter_params(spec) * a_bytes
        out = {"trainable adapters": adapters}
        if ft.method == "qlora":
            out["quantized base"] = ft.quantized_bytes(spec)
            out[f"frozen {'fp32' if p == 4 else 'bf16'} weights"] = params - adapters - out["quantized base"]
        else:
            out["frozen base"] = params - adapters
        return out
    trained = ft.trainable_params(spec) * p
    return {"trainable": trained, "frozen": params - trained}


@dataclass(frozen=True)
class TrainableParts:
    """The model state of a fine-tuning run that trains part of the model (core.finetune)."""

    params_bytes: int  # every parameter as stored (frozen base, quantized base, adapters)
    copies_bytes: int  # autocast's 16-bit copies of matmul weights, kept until backward
    layout: tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]  # trainable tensors
    layout_layers: int  # how often ``layout``'s layer part repeats
    grad_bytes: int  # element size of the trainable parameters (their gradients and optimizer state)
    grads_bytes: int  # all gradients
    layers_trained: int  # decoder layers whose own weights train (frozen ``last:N``)
    layer_grads: int  # gradient bytes of one layer (adapters or its weights)
    mlp_grads: int  # of which in the MLP
    down_grads: int  # of which in the down projection
    head_trainable: bool
    embeddings_trainable: bool
    norms_trainable: bool


def trainable_parts(spec: ModelSpec, ft: FineTuning, p: int) -> TrainableParts:
    """Parameters, copies and trainable layout for LoRA/QLoRA adapters or frozen parts.

    LoRA: the base keeps the precision's dtype, adapters the adapter dtype (peft's fp32 by default). QLoRA: the
    decoder-layer linears are bitsandbytes-quantized (``FineTuning.quantized_bytes``), everything else in ``p``
    (fp32 once ``prepare_model_for_kbit_training`` cast it), and the 4-bit weights are dequantized into
    transients (no autocast copies of them). Frozen: the named parts train in the parameter dtype."""
    h = spec.hidden_size
    a_bytes = 2 if ft.adapter_dtype == "bf16" else 4
    parts = {part.strip().lower() for part in ft.trainable}
    last = max((int(part[5:]) for part in parts if part.startswith("last:")), default=0)
    if ft.uses_adapters:
        adapted = ft.adapted(spec)
        layer: list[tuple[int, int]] = [shape for lin in adapted
                                        for shape in ((ft.rank, lin.d_in), (lin.d_out, ft.rank))]
        adapters = ft.adapter_params(spec)
        per_layer = adapters // spec.num_layers
        mlp = sum(ft.rank * (lin.d_in + lin.d_out) for lin in adapted if lin.kind in ("gate", "up", "down", "gate_up"))
        down = sum(ft.rank * (lin.d_in + lin.d_out) for lin in adapted if lin.kind == "down")
        matmul_frozen = spec.matmul_weight_params
        if ft.method == "qlora":
            quantized = ft.quantized_params(spec)
            base = ft.quantized_bytes(spec) + (spec.num_params - quantized) * p  # fp32 once prepare_kbit cast it
            matmul_frozen -= quantized  # dequantized into transients, not cached by autocast
        else:
            base = spec.num_params * p
        return TrainableParts(
            params_bytes=base + adapters * a_bytes, copies_bytes=(matmul_frozen + adapters) * 2,
            layout=([], layer, []), layout_layers=spec.num_layers, grad_bytes=a_bytes,
            grads_bytes=adapters * a_bytes, layers_trained=0, layer_grads=per_layer * a_bytes,
            mlp_grads=mlp * a_bytes, down_grads=down * a_bytes, head_trainable=False, embeddings_trainable=False,
            norms_trainable=False)
    _before, one_layer, _after = spec.param_layout()
    layers = min(last, spec.num_layers)
    trainable = ft.trainable_params(spec)
    v = spec.vocab_size
    before_t: list[tuple[int, int]] = [(v, h)] if "embeddings" in parts else []
    after_t: list[tuple[int, int]] = []
    if "norms" in parts:
        after_t += [(h, 1)] * (spec.norms_per_layer * (spec.num_layers - layers) + 1)
    if "lm_head" in parts and not (spec.tied_embeddings and "embeddings" in parts):
        after_t.append((v, h))
    # autocast keeps 16-bit copies where an input gradient needs them: in the trained layers and the head (frozen
    # layers below them see no gradient); with trainable embeddings or norms every layer does
    everywhere = bool({"embeddings", "norms"} & parts) or (spec.tied_embeddings and "lm_head" in parts)
    layer_matmul = (spec.matmul_weight_params - v * h) // spec.num_layers
    copies = spec.matmul_weight_params if everywhere else layers * layer_matmul + v * h
    return TrainableParts(
        params_bytes=spec.num_params * p, copies_bytes=copies * 2,
        layout=(before_t, one_layer if layers else [], after_t),
        layout_layers=max(layers, 1), grad_bytes=p, grads_bytes=trainable * p, layers_trained=layers,
        layer_grads=spec.layer_params * p if layers else 0, mlp_grads=spec.mlp_params * p if layers else 0,
        down_grads=h * spec.intermediate_size * p if layers else 0,
        head_trainable=bool({"lm_head"} & parts or (spec.tied_embeddings and "embeddings" in parts)),
        embeddings_trainable=bool({"embeddings"} & parts or (spec.tied_embeddings and "lm_head" in parts)),
        norms_trainable="norms" in parts)
