"""Vision-language support: per-family image placeholder rules, prompt building, image keys (issue 40)."""
