"""Model definitions (Llama family) and their loading from Hugging Face folders."""
