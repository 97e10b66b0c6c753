"""`python -m ringtrain -np N python train.py ...`: the ringtrain-run launcher, where its script is not on PATH."""
from .launch.run import main

if __name__ == "__main__":
    main()
