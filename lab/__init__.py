"""The project's own measurement tools: the scale model (lab.sim) and the proxy placement
planner (lab.placement). They import the fasthorovod package; the package never imports them."""
