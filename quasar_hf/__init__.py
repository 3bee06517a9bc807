"""quasar_hf."""
