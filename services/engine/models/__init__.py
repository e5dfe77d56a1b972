"""Model families, each a compact nn.Module that calls `services.engine.attention.paged_attention`.

The interface every family implements (the runner relies on nothing else):

    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    hidden = model(input_ids, positions, kv_caches, meta)
        # input_ids  [num_tokens] int64, positions [num_tokens] int64 (absolute positions),
        # kv_caches  list (one per layer) of [2, num_blocks, block_size, num_kv_heads, head_dim],
        # meta       AttentionMetadata for the step; hidden [num_tokens, hidden_size]
    logits = model.compute_logits(hidden)  # [n, vocab_size] float32
    model.spec  -> ModelSpec (num_layers, num_kv_heads, head_dim, vocab_size, max_position, dtype)
"""
