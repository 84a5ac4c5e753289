"""The embedded tiny model's task (tinymath), char-level tokenizer and benchmark."""
