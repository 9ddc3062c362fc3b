"""Text: corpora and packs, tokenizers, token frequency and sentence scores, analysis sentences (docs/design.md §2)."""
