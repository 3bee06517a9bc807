"""Model cards (`model_card`) and pushing a Quasar model with its card to the Hugging Face Hub (`push`)."""
