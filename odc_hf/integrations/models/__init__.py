"""What a model family's definition asks of packed-row training: the family rules and the behavioural check before
training."""
