"""Varied chat prompts for tests on the real model."""

PARITY_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "Explain photosynthesis in one sentence."}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one word."},
     {"role": "user", "content": "What colour is the sky on a clear day?"}],
    [{"role": "user", "content": "List three prime numbers greater than 10."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Describe your ship."}],
    [{"role": "user", "content": "What is 17 times 23?"}],
    [{"role": "user", "content": "Give me a recipe for pancakes."}],
    [{"role": "user", "content": "Why do cats purr?"}],
    [{"role": "user", "content": "Summarise the plot of Romeo and Juliet in two sentences."}],
    [{"role": "user", "content": "Write a SQL query that counts rows in a table named users."}],
    [{"role": "user", "content": "What are the three states of matter?"}],
    [{"role": "system", "content": "Reply in French."},
     {"role": "user", "content": "How are you?"}],
    [{"role": "user", "content": "Name a famous painting by Leonardo da Vinci."}],
    [{"role": "user", "content": "Is a tomato a fruit or a vegetable? Explain briefly."}],
    [{"role": "user", "content": "Write a limerick about a programmer."}],
    [{"role": "user", "content": "What does HTTP stand for?"},
     {"role": "assistant", "content": "HTTP stands for HyperText Transfer Protocol."},
     {"role": "user", "content": "And HTTPS?"}],
    [{"role": "user", "content": "Give two tips for better sleep."}],
    [{"role": "user", "content": "How many legs does a spider have?"}],
]


def encode(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)
