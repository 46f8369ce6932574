"""Chat: templates found and rendered as transformers does them."""
