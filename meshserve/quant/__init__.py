"""Post-training INT8 W8A8 quantization (RTN, SmoothQuant, SmoothQuant + GPTQ) into compressed-tensors
checkpoints, and the quality evaluator that runs a checkpoint's W8A8 math against its float original.

`pipeline.quantize(model_dir, out_dir, method, calibration)` writes the checkpoint (format:
`meshserve.models.compressed_tensors`); `evaluate.quality(reference_dir, quantized_dir, data)` measures it.
Calibration and evaluation data arrive as token ids or texts: this package reads no corpus itself.
"""
