"""Where ringtrain's compiled sources are: ringtrain/_csrc in an installed wheel (setup.py copies csrc/ there),
else <repo>/csrc in a source checkout or editable install."""
import os


def find(files):
    """The directory holding every one of `files` (names of csrc/ sources)."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = (os.path.join(here, "_csrc"), os.path.join(os.path.dirname(here), "csrc"))
    for candidate in candidates:
        if all(os.path.isfile(os.path.join(candidate, f)) for f in files):
            return candidate
    raise FileNotFoundError(f"ringtrain's sources ({', '.join(files)}) are neither in {candidates[0]} nor in "
                            f"{candidates[1]}; reinstall ringtrain (the wheel ships them as ringtrain/_csrc)")
