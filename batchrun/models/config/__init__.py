"""A model's configuration read without its weights: config.json, the native decoder's shape, a spec's config, classifier labels."""
