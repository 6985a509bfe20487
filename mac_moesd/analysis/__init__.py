"""From measurements to answers: the MoESD theory, the fit, acceptance, and a results digest."""
