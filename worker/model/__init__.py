"""The model: loading the base and adapters under the budget (`loading.py`), the NF4 config (`quantization.py`),
the tokenizer side (`tokens.py`) and the libraries' required features (`library_features.py`)."""
