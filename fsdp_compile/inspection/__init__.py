"""How a schedule is shown, estimated and chosen: tables, traces, timelines, logs, the cost model, hardware presets, autotuning."""
