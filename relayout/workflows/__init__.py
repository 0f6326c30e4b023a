"""The commands that run the whole pipeline on a disk: ``relayout demo`` (:mod:`.demo`) and
``relayout validate`` (:mod:`.validation`), and the work directory each records what it made in
(:mod:`.workdir`)."""
