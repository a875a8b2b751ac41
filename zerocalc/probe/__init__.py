"""Measurements of a running DeepSpeed job, shared by the validator's worker and a probe of a user's own
job. Importing it imports neither torch nor DeepSpeed; its functions import them."""
