"""Where a model's files come from and how they load: names and the bundled default, spec resolution, GGUF and .bin conversion."""
