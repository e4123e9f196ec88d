"""The model: OLMoE-style MoE, expert ownership, the merge warm-up, Hugging Face interop."""
