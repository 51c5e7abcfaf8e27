"""gloader inside the trainers users run, where a trainer's own hooks need a word from gloader:
`gloader.integrations.transformers` (the transformers Trainer) and
`gloader.integrations.accelerate` (Hugging Face Accelerate). Each imports its trainer, which
gloader does not install: import the module you need. Lightning needs nothing of these.
"""
