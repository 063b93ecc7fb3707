"""`pdserve chaos --soak`: sustained load under a seeded nemesis of overlapping faults, a recorded
history and a checker's verdict."""
