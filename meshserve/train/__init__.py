"""Training a preset on the standard-library corpus, with DeepSeek-V3's MTP objective."""
