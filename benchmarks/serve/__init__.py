"""Served: quasar-hf serve under load beside transformers serve and llama-server; the export served by vLLM."""
