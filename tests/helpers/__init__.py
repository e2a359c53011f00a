"""What several test files share and no test file is: tiny random Hugging Face models
(hf_models), chat templates of the released forms (chat_templates), generated videos
(video_files) and Energon datasets (energon_data), FLOPs counted by hand (flops_by_hand), the
runs several files read (dp_runs, finetune_runs), and megatron_workers/, the worker scripts the
Megatron tests run on local ranks. Imported as `from tests.helpers import hf_models`."""
