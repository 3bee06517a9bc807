"""Serving Quasar models through Transformers' own server (`quasar-hf serve`): transformers_server.py."""
