#!/bin/bash
# The forty-fourth and forty-fifth sessions' code in one device call (~8 min at most), run so far on H100s only
# (RESULTS.md): bitsandbytes checkpoints and --quantization (bnb_gpu_check.py), the NF4 kernels against
# bitsandbytes, cuBLAS and int4 tiled (bench_codebook4.py), the structured-output engine check, NF4 against int4
# batch-1 decode, Gemma 3 / Mistral 3 / SmolLM3 against transformers (kernels, engine, graphs). On an H200 it gives
# the first numbers there. Before the call, on the CPU machine:
#   ../shared/device/fetch-wheels.sh bitsandbytes==0.50.2 jsonschema jsonschema-specifications referencing rpds-py attrs
#   mkdir -p benchmarks/_tok && cp ~/.cache/fitllm/gguf-SmolLM2-*/{chat_template.jinja,config.json,\
#     generation_config.json,tokenizer.json,tokenizer_config.json} benchmarks/_tok/
# then run `bash benchmarks/gpu_first_checks.sh` with .whl carried.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
t0=$SECONDS
timeout 100 python3 benchmarks/gpu_families_check.py --families gemma3,gemma3-mm,mistral3-mm,smollm3-window,llama 2>&1 | grep -v Warning | tail -12; echo "[$((SECONDS-t0)) s]"
timeout 90 python3 benchmarks/bnb_gpu_check.py --workdir /tmp/bnb-gpu 2>&1 | grep -v Warning | tail -8; echo "[$((SECONDS-t0)) s]"
timeout 150 python3 benchmarks/bench_codebook4.py --m 1,4,16,64,256,1024 --out $OUT/cb 2>&1 | grep -v Warning | tail -12; echo "[$((SECONDS-t0)) s]"
timeout 120 python3 benchmarks/structured_gpu_check.py benchmarks/_tok 2>&1 | grep -v Warning | tail -8; echo "[$((SECONDS-t0)) s]"
timeout 110 python3 benchmarks/bench_serving.py --parts decode --decode-schemes nf4,int4 --decode-kv auto --no-hf-peer --out $OUT/serve 2>&1 | grep -v Warning | tail -6; echo "[$((SECONDS-t0)) s]"
