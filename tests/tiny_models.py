"""Small configs of three families (llama, tied qwen2, gpt2) whose real CPU steps take a second: the cases the
technique tests (chunked loss, step in backward) measure."""

COMMON = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=1024)
CONFIGS = {
    "llama": dict(COMMON, model_type="llama", vocab_size=8192, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "qwen2-tied": dict(COMMON, model_type="qwen2", vocab_size=16000, hidden_size=64, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", vocab_size=8000, n_embd=128, n_layer=2, n_head=4, n_positions=1024),
}
