set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
data=(data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' train.eval_interval=0 data.seq_len=2048)
b7="model.hf.hidden_size=3584 model.hf.intermediate_size=18944 model.hf.num_hidden_layers=28 model.hf.num_attention_heads=28 model.hf.num_key_value_heads=4 model.hf.tie_word_embeddings=false model.hf.vocab_size=152064 train.micro_batch_size=8 parallel.activation_checkpointing=selective"
python3 -m muonrun bench qwen2-adamw-fsdp2 "${data[@]}" $b7 --steps 6 --warmup 3 --variant fill:optimizer.name=muon --out "$OUT/r22/results.json" 2>&1 | grep "│ *fill "
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -m gpu 2>&1 | tail -2
