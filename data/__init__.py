"""Data: tokenizers, document sources, packing into samples, and the globally ordered loader."""
