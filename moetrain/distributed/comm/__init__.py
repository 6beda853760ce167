"""What the collectives share: names across torch versions, byte counters, timers."""
