"""Model families that run on jaxkv caches.

`models.llama`: Flax NNX Llama 2 / 3 / 3.1 with HF checkpoint loading.
"""
