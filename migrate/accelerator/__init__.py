"""What only a real accelerator can prove, run as one prepared check (`migrate.accelerator.check`)."""
