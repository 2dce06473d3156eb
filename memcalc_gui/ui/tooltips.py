"""What each input changes in the ledger, and the seed formula behind it (shown as tooltips)."""

from __future__ import annotations

TOOLTIPS: dict[str, str] = {
    "model_kind": (
        "Where the architecture comes from. A preset or a config.json gives the analytic method "
        "(the block counted tensor by tensor); a bare parameter count gives the quick method, "
        "a rough heuristic from Hugging Face blog."
    ),
    "preset": (
        "A built-in Hugging Face config. Decides N (parameters = N × P bytes, Hugging Face blog: Model Memory = N·P), "
        "the activations each layer keeps and the logits. Type to filter the list."
    ),
    "hub_id": (
        "A model's Hugging Face Hub id (org/name) or a local model folder. Its config.json comes from the local "
        "Hugging Face cache (HF_HOME) when it is there; otherwise press Fetch to download the config (only the "
        "config) from the Hub — gated models need you logged in (hf auth login) or HF_TOKEN."
    ),
    "config_path": (
        "A Hugging Face config.json (open it, paste its path, or drop it on the window). The exact parameter "
        "count and per-layer activations come from its sizes; supported families are listed in the error "
        "if it is not one of them."
    ),
    "params": (
        "Only a parameter count N (1.5B, 350M or 1.5e9): method quick, Hugging Face blog's rough heuristic\n"
        "Total = N·P + 2·N·P + max(2·N·P, A·B·L·P), A = 4.6894e-4·N + 1.8494e6 activations per token.\n"
        "It overestimates activations (≈ +70 % at 1.5B, several × on small models)."
    ),
    "batch": (
        "Micro-batch B: sequences per forward/backward pass. Scales activations, temporaries and inputs "
        "(Hugging Face blog: Activations = A·B·L·P); parameters, gradients and optimizer state do not change. "
        "Up/Down change it by 1, PgUp/PgDn double or halve it."
    ),
    "seq": (
        "Sequence length L in tokens. Activations and inputs grow with B·L (Hugging Face blog: A·B·L·P); eager "
        "attention adds B·heads·L² score matrices per layer (Korthikanti et al. 2022, the 5as/h term)."
    ),
    "grad_accum": (
        "Micro-batches per optimizer step. Gradients accumulate in place, so memory does not change; "
        "only the effective batch = micro-batch × accumulation does (memory ledger: micro-batch vs accumulation)."
    ),
    "checkpointing": (
        "Gradient checkpointing keeps only each layer's input and recomputes the rest during backward: "
        "activations shrink to one saved input per layer (memory-profiling guide: checkpointing saves 40–60 % of "
        "activations), and backward runs one extra forward."
    ),
    "tuning": (
        "Which weights train. All: full fine-tuning. LoRA: the base is frozen and peft adds rank-r adapters "
        "(r·(d_in + d_out) weights per adapted linear, fp32 by default) — gradients and optimizer state exist for "
        "them only. QLoRA: LoRA on a base whose decoder-layer linears bitsandbytes stores in 4 bits (NF4, ~0.52 "
        "B/weight with double quantization); embeddings, norms and the output head are cast to fp32 by peft's "
        "prepare_model_for_kbit_training. Some parts: only what 'Trainable parts' names trains."
    ),
    "lora_rank": "LoRA rank r (peft LoraConfig.r). Adapter weights and their activations grow linearly with it.",
    "lora_targets": (
        "Which linears get adapters (peft target_modules): all-linear (every linear but the output head, as peft), "
        "attention, mlp, or a comma-separated list of kinds (q, k, v, o, gate, up, down) or module names "
        "(q_proj, v_proj, c_attn, …)."
    ),
    "lora_dropout": (
        "peft's lora_dropout. Above 0 every adapted module keeps its own dropout output and mask for backward "
        "(the mask as bool on CUDA)."
    ),
    "quant": "How bitsandbytes stores the frozen base under QLoRA: NF4 or FP4 (4-bit, blocks of 64), or LLM.int8.",
    "prepare_kbit": (
        "peft's prepare_model_for_kbit_training casts every weight bitsandbytes leaves unquantized (embeddings, "
        "norms, the output head) to fp32 — 4 B instead of 2 per weight, and fp32 activations without autocast. "
        "Most QLoRA scripts call it; off, those weights keep the precision's dtype."
    ),
    "double_quant": "Quantize the 4-bit blocks' scales too (bnb_4bit_use_double_quant): ~0.516 instead of 0.5625 B.",
    "trainable": (
        "With 'Some parts': what trains, comma-separated — last:N (the top N decoder layers), norms, lm_head, "
        "embeddings. Layers below the lowest trained part keep no activations."
    ),
    "use_cache": (
        "Whether the training loop leaves the config's use_cache=True. transformers then fills a DynamicCache "
        "during forward: every layer's k and v are copied (torch.cat) and attention runs on the copies, which "
        "moves the forward and backward peaks by up to a few per cent (more for fused-qkv models such as GPT-2). "
        "Trainer passes use_cache=False; with gradient checkpointing transformers gives the layers no cache."
    ),
    "attention": (
        "sdpa (flash / memory-efficient kernels) keeps no L×L score matrix; eager stores the softmax "
        "scores and dropout mask, B·heads·L² per layer (Korthikanti et al. 2022: sbh(34 + 5as/h)). "
        "FlashAttention-2 (transformers' flash_attention_2, the flash-attn package, 16-bit only) keeps what SDPA's "
        "flash kernel keeps and attends within packed documents without a mask."
    ),
    "recipe": (
        "Precision presets. Choosing one fills precision and optimizer; both stay editable.\n"
        "fp32: 4 B/param weights + 4 B grads + 8 B Adam state.\n"
        "Mixed precision: 6 B/param weights (fp32 master + 16-bit copy, Transformers docs), fp32 grads, "
        "Adam 8 B/param.\n"
        "8-bit Adam: mixed precision with quantised optimizer state, 2 B/param (Transformers docs).\n"
        "QLoRA (4-bit base): the QLoRA paper's recipe — NF4 base with double quantization, bf16 autocast, paged "
        "32-bit AdamW, gradient checkpointing; it also sets Fine-tuning to QLoRA."
    ),
    "precision": (
        "fp32: weights, gradients and activations in 4 bytes (Hugging Face blog: P = 4).\n"
        "Mixed: fp32 master weights + 16-bit copies of matmul weights (6 B/param, Transformers docs), fp32 gradients, "
        "16-bit activations.\nbf16: pure 16-bit weights, gradients and optimizer state (2 B/param each).\n"
        "bf16 + autocast: a bf16-loaded model trained with autocast on (Trainer's bf16=True): the same bytes as "
        "bf16 for full fine-tuning, but LoRA's fp32 adapters and their inputs get autocast's 16-bit copies."
    ),
    "optimizer": (
        "Optimizer state per parameter (green in the chart): AdamW/Adam keep two moments, 2·N·P "
        "(Hugging Face blog; 8 B/param in fp32, Transformers docs); 8-bit AdamW ≈ 2 B/param (Transformers docs); "
        "paged AdamW (bitsandbytes, 8-bit or 32-bit) keeps tensors of 100,000 elements or more in CUDA unified "
        "memory (light green): outside max_memory_allocated, and evicted to host memory when the GPU runs out; "
        "SGD none; "
        "SGD-momentum and Lion one buffer; Adafactor factored second moments (rows + columns)."
    ),
    "optimizer_impl": (
        "Optimizer temporaries during the step (red in the chart): foreach ≈ one more copy of all "
        "parameters (Hugging Face blog: intermediates = N·P); single-tensor ≈ the largest tensor or two; fused ≈ 0."
    ),
    "gpu": (
        "GPU preset: fills the capacity with what the device reports to PyTorch (total_memory), "
        "a little below the marketing size (a \"24 GB\" card reports ~23.6–23.99 GiB)."
    ),
    "capacity": (
        "Device memory the verdict compares the peak phase with. Units: GiB, GB, MiB, MB or bytes "
        "(80GiB, 80GB, 24e9). Empty: no verdict."
    ),
    "cuda_context": (
        "Memory the CUDA context holds outside PyTorch's tensors, added to every phase (grey). "
        "A Zhihu article on PyTorch's GPU memory measured 1.35–1.64 GB with older CUDA; with CUDA 12's lazy "
        "module loading it is about 0.5 GiB."
    ),
    "allocator_reserve": (
        "Memory the caching allocator reserves but cannot use (fragmentation), as a percentage of each "
        "phase's tensor bytes (light grey). The DeepHub IMBA memory-profiling guide puts it at 5–20 %."
    ),
    "gpus": (
        "Data-parallel GPUs of the chosen kind. With more than one GPU (or a sharding strategy) the chart, "
        "the ledger and the verdict are per GPU: activations stay those of one micro-batch, the model state "
        "is replicated (DDP) or sharded over the GPUs (ZeRO, FSDP). Up/Down change it by 1, PgUp/PgDn double "
        "or halve it."
    ),
    "strategy": (
        "How the model state is spread over the GPUs (mixed precision + Adam, bytes per parameter Ψ):\n"
        "DDP: every GPU holds everything, 16Ψ plus DDP's gradient buckets.\n"
        "ZeRO-1/2/3 (Rajbhandari et al. 2020, \"ZeRO\"): (2 + 2 + K)Ψ with K = 12 → 2Ψ + 2Ψ + KΨ/N (stage 1), "
        "2Ψ + (2 + K)Ψ/N (stage 2), (2 + 2 + K)Ψ/N (stage 3); DeepSpeed's estimate_zero2/zero3_model_states_"
        "mem_needs add an fp32 gradient partition, reduce buckets and the largest layer gathered (4·L).\n"
        "FSDP (PyTorch FSDP docs): FULL_SHARD ≈ ZeRO-3 with the root unit and two units gathered "
        "(limit_all_gathers); SHARD_GRAD_OP keeps parameters gathered from forward to backward (≈ ZeRO-2); "
        "HYBRID_SHARD shards within a node and replicates across nodes.\n"
        "FSDP2 (PyTorch's fully_shard, as torchtitan applies it) shards over the data- and context-parallel GPUs of "
        "each tensor-parallel group and pipeline stage: beside tensor or pipeline parallelism it needs two or more "
        "of them (over one it shards nothing, and torchtitan applies none)."
    ),
    "node_size": (
        "GPUs per node. FSDP HYBRID_SHARD shards the state over one node's GPUs only; with offload the host "
        "memory is needed once per node (DeepSpeed's estimators: host bytes × GPUs per node × 1.5 buffer factor)."
    ),
    "loss": (
        "How the loss is computed. Full: transformers' causal-LM loss makes the tokens × vocabulary logits, an fp32 "
        "copy and the log-softmax, and their gradients in backward — several GiB at long sequences and large "
        "vocabularies. Chunked: Liger-Kernel's fused linear cross-entropy (LigerFusedLinearCrossEntropyLoss) makes "
        "the logits a chunk of tokens at a time and computes the hidden-state and head-weight gradients in "
        "forward, so the full logits never exist."
    ),
    "galore_rank": (
        "GaLore's rank r (Zhao et al. 2024; galore-torch's GaLoreAdamW, Trainer's optim=\"galore_adamw\" with "
        "optim_target_modules=[\"attn\", \"mlp\"] and optim_args=\"rank=...\"): each attention and MLP weight keeps "
        "Adam's moments of an r-row projection of its gradient and the projection matrix. Default 128."
    ),
    "packing": (
        "Padding-free packing, as transformers' DataCollatorWithFlattening and TRL's padding_free do it: the "
        "micro-batch's documents are concatenated into one row without padding, position_ids restarting at each "
        "document, so activations scale with the real tokens and attention stays within each document. With SDPA, "
        "transformers builds an L × L block-diagonal mask that SDPA keeps in every layer; FlashAttention-2 needs none."
    ),
    "tokens_per_batch": (
        "Real tokens per micro-batch once packed: micro-batch × your mean document length (at most micro-batch × "
        "sequence length, the default). 4k, 16K and 1M are accepted."
    ),
    "activation_offload": (
        "Keep what the decoder layers save for backward in host (CPU) memory and copy it back when backward needs it. "
        "Checkpoint inputs: with gradient checkpointing each layer keeps only its input, and that goes to the host "
        "(torchtune's OffloadActivations, which overlaps the copies with compute). Every saved tensor: PyTorch's "
        "torch.autograd.graph.save_on_cpu, weights' saved copies included, without checkpointing. The head and the "
        "loss keep theirs on the GPU. The result shows the host memory it needs."
    ),
    "ckpt_selective": (
        "Per-op selective checkpointing, as torchtitan's \"op\" policy: every layer is checkpointed, but the outputs "
        "of its attention kernel and of every other matrix product are kept rather than recomputed "
        "(torch.utils.checkpoint's create_selective_checkpoint_contexts). More memory than full checkpointing, less "
        "recomputation. Modelled with SDPA attention and full fine-tuning."
    ),
    "ckpt_every": (
        "With checkpointing on: checkpoint every N-th decoder layer only (layers N, 2N, …), the others keep their "
        "activations — torchtitan's selective layer checkpointing (ac_freq). Empty or 1: every layer. Fewer "
        "checkpointed layers recompute less and keep more."
    ),
    "optimizer_in_backward": (
        "Step each parameter as soon as its gradient is accumulated, then free the gradient (PyTorch's tutorial "
        "\"How to save memory by fusing the optimizer step into the backward pass\"; torchtune's optimizer_in_bwd). "
        "No gradients pile up in backward and the optimizer phase keeps only the weights and the state. It needs a "
        "training loop that does it, and rules out gradient accumulation and clipping by the global norm."
    ),
    "loss_chunk": (
        "Tokens per chunk of the chunked loss. Empty: Liger's rule, next_power_of_2(ceil(tokens / ceil(V / H))), "
        "so that one chunk's logits are about as large as the hidden states."
    ),
    "dp_replicate": (
        "FSDP2's hybrid sharding (HSDP; torchtitan's data_parallel_replicate_degree): the data-parallel GPUs form "
        "this many replicas, each fully_shard-ed over its own GPUs (a 2-D device mesh). Each GPU holds 1/(its "
        "replica's GPUs) of the weights, gradients and optimizer state; the gradients are reduce-scattered within a "
        "replica, then all-reduced across replicas. 1 (the default) shards over every data-parallel GPU. Typically "
        "one replica per node, so the all-gathers stay on NVLink."
    ),
    "reshard_after_forward": (
        "FSDP2 (torch.distributed.fsdp.fully_shard): free each decoder layer's gathered weights after its forward "
        "and gather them again for its backward (on, the default), or keep every layer gathered from its forward to "
        "its backward (off: less communication, the whole model's 16-bit weights on every GPU at the end of "
        "forward). The root unit (embeddings, final norm, head) stays gathered either way. The zero-bubble pipeline "
        "schedules need it off."
    ),
    "ep": (
        "Expert parallelism (a mixture of experts only): the routed experts of every MoE layer are split over this "
        "many GPUs, each group of GPUs holding the same experts replicated or sharded by the strategy; attention, "
        "shared experts, router and embeddings are laid out over all GPUs. It must divide the number of GPUs and "
        "the experts per layer. Balanced routing is assumed, and one layer's all-to-all buffers are counted "
        "(transformers', torchtitan's and Megatron-LM's expert-parallel token dispatch)."
    ),
    "etp": (
        "Expert tensor parallelism, Megatron-LM's --expert-tensor-parallel-size (its strategies only): each routed "
        "expert's weights are split over this many GPUs besides the expert-parallel split: the field above times "
        "this one is how many GPUs hold one copy of every expert, and the distributed optimizer shards each copy "
        "over the GPUs that hold the same slices. The tokens of these GPUs are gathered before each expert's slice, "
        "so each MoE layer's saved expert inputs grow this many times. 1 (the default) keeps every expert whole."
    ),
    "tp": (
        "Tensor parallelism: each decoder layer's attention heads and MLP width are split over this many GPUs, as "
        "transformers' own tensor-parallel plans split them (q/k/v and gate/up column-wise, o and down row-wise; "
        "PyTorch's ColwiseParallel/RowwiseParallel). Embeddings, norms and the head stay whole on every GPU. It must "
        "divide the number of GPUs, the attention heads, the key/value heads and the MLP width; the strategy above "
        "runs over the GPUs / tp data-parallel replicas. Checked against the real model parallelized with "
        "parallelize_module on PyTorch's fake process group."
    ),
    "sp": (
        "Sequence parallelism (with tensor parallelism): what the tensor-parallel regions leave whole on every GPU "
        "— the norms and the residual stream — is split along the sequence over the tensor-parallel GPUs "
        "(Korthikanti et al. 2022, \"Reducing Activation Recomputation in Large Transformer Models\"). With FSDP2 "
        "as PyTorch runs it (torchtitan's plan: attention and the MLP gather the sequence first and keep that "
        "gathered input); with DDP, ZeRO or Megatron-LM as Megatron-LM runs it (the gathered input is not kept). "
        "A model traced without a block model (a mixture of experts, Gemma 2, …) runs PyTorch's plan: beside "
        "FSDP2, or under DDP when every GPU is tensor-parallel (one replica)."
    ),
    "loss_parallel": (
        "With tensor parallelism: the embedding's rows and the LM head's columns are split over the tensor-parallel "
        "GPUs too, and each computes the loss over its slice of the logits (torchtitan's loss parallel; Megatron-LM's "
        "vocab-parallel embedding and cross-entropy). Without it the embedding and head stay whole on every GPU and "
        "each holds the full logits (transformers' plans). Until you tick or clear it the box follows the strategy: "
        "on under FSDP2 (torchtitan's default), off under DDP, ZeRO and FSDP1; always on under Megatron-LM."
    ),
    "loss_parallel_megatron": (
        "Megatron-LM always splits the vocabulary over the tensor-parallel GPUs: its embedding is a "
        "VocabParallelEmbedding, its output layer column-parallel and its loss vocab_parallel_cross_entropy, with no "
        "option to keep them whole. (A family memcalc has no block model of is estimated with them whole, an upper "
        "bound, and the result says so.)"
    ),
    "cp": (
        "Context parallelism: each sequence split over this many GPUs (two chunks each, for a balanced causal mask), "
        "attention run as ring attention passing key/value chunks round the GPUs (torchtitan's context_parallel). Each "
        "GPU runs its share of the tokens; parameters, gradients and optimizer state are sharded over the data- and "
        "context-parallel GPUs together. For long sequences; Precise (trace) runs PyTorch's own ring attention."
    ),
    "pp": (
        "Pipeline parallelism: the decoder layers are split evenly into this many stages, one per GPU (the first "
        "also holds the embedding, the last the final norm, the LM head and the loss). The step's micro-batches are "
        "the gradient-accumulation steps. The chart shows the most loaded stage; the GPUs must be a multiple of "
        "tensor parallel × stages. Checked against PyTorch's own pipeline schedules (torch.distributed.pipelining) "
        "run on the fake process group."
    ),
    "schedule": (
        "How the stages order the micro-batches' forwards and backwards, and so how many micro-batches of "
        "activations a stage keeps at once: GPipe all of them; 1F1B as many as there are stages after it "
        "(Narayanan et al. 2021); interleaved 1F1B, several smaller stages per GPU, a little more. The "
        "zero-bubble schedules (Qi et al. 2024) split each backward into the input's gradient and the weights', "
        "deferred to fill the pipeline's idle time: each micro-batch keeps its activations, and the output gradients "
        "the weights' step starts from, until that step has run (modelled beside DDP, and beside FSDP2 without "
        "resharding after forward, as torchtitan runs it: resharded, PyTorch's weight step gets the gradients wrong; "
        "not yet with checkpointing, sequence or context parallelism)."
    ),
    "virtual_stages": "Stages per GPU under the interleaved schedules (2 or more for interleaved 1F1B, 1 or more for "
                      "interleaved zero bubble, exactly 2 for zero bubble V; the layers must split into stages × this "
                      "many pieces).",
    "offload": (
        "Move model state to CPU memory; the chart then shows less on the GPU and the host memory needed per "
        "node is listed. The choices are the ones that differ for the strategy.\nZeRO-1/2/3, optimizer: "
        "ZeRO-Offload (optimizer state, fp32 master and gradient partitions; the step runs on the CPU).\n"
        "ZeRO-3, optimizer and parameters: ZeRO-Infinity (only the gathered units stay on the GPU).\n"
        "FSDP: its one CPUOffload moves the parameter and gradient shards and runs the step on the CPU.\n"
        "DDP cannot offload."
    ),
}


def rich(text: str) -> str:
    """A tooltip Qt word-wraps (rich text wraps at a readable width; plain text is one line per paragraph)."""
    import html

    return "<qt>" + html.escape(text).replace("\n", "<br>") + "</qt>"


TOOLTIPS = {key: rich(value) for key, value in TOOLTIPS.items()}
