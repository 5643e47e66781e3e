"""Templates of the Python files a Hugging Face export carries (`mamba3lite.interop.hf_modeling` reads
them as text). Never imported by the package: they import transformers."""
