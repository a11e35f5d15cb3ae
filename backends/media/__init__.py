"""Decoding of what clients send: images (Pillow, or nvJPEG + torch on the device) and audio (soundfile + soxr)."""
