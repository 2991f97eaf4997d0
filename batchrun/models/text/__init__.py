"""Text in and out of a model: the tokenizer and the chat template, without transformers."""
