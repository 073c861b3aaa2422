"""Generation backends: the static decoder (decoding.py and its model side), seeded sampling, decoder
slots, the vLLM engine, and what a generator reports besides its samples."""
