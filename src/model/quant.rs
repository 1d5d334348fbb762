//! q8_0 quantization (GPU issue).
