"""The MLX worker: a token engine whose main thread makes every MLX call."""
