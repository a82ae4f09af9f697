"""Model files: what `--model` names -> a local folder (model_source, pull), a GGUF -> a folder (gguf_files),
reading a folder's JSON (model_files), and its tokenizer and chat template (tokenizer). Part of the shared
ground: imports no service."""
