"""The torch models a pipeline trains: built-in, Hugging Face and user models, initialised."""
