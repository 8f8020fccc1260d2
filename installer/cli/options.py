"""What several command groups say the same way."""

STATE_DEFAULT = "Default: .hiddenplane/<cluster> next to the inventory file."
