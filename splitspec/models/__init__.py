"""The model families the target serves, below the runner: dense Llama / Qwen (`dense`), and the
Kimi hybrid family (`hybrid`: KDA linear attention, MLA, MoE with MXFP4 experts). Each model
has one forward path, `forward_batch` over the runner's paged pool; tools drive it through
`target_service.engine`."""
