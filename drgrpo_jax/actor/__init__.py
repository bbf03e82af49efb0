"""The actor: what samples and scores (`actor.Actor`), for training and evaluation alike."""
