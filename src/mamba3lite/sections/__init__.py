"""The sections of a run's config, one module each, and how a section is built from YAML values.

    fields.py          doc(): a field that documents itself; the checks every section applies
    training.py        TrainingConfig (`training:`): optimisation, schedule, cadence, checkpoints
    data.py            DataConfig (`data:`): where the tokens come from
    logging_sinks.py   LoggingConfig (`logging:`): where the metrics rows go
    values.py          build_section: a mapping of YAML or --set values, coerced to the fields' types

The `model:` section is ModelConfig (mamba3lite/model/config.py). The whole config (`Config`, presets,
`load_config`, `--set` overrides) is mamba3lite/config.py, which imports these and is where callers
import them from.
"""
