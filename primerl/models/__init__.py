"""The MoE transformer family and Hugging Face checkpoint I/O, built on the layers below."""
