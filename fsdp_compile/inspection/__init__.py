"""How a schedule is shown, estimated and chosen: listings, timelines, logs, the cost model, autotuning."""
