"""Act on what was measured: model transforms, optimize(), TrainStep, DataLoader tuning."""
