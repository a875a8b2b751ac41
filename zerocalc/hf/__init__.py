"""Hugging Face causal LMs read from their own code: the optional `trace` extra
(`pip install 'zerocalc[trace]'`: torch and transformers, imported only when a config is traced)."""
