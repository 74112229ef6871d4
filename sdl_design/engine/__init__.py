"""The engine under the stages: partitions, the map and exchange over them (in this process or
on Dask workers), and the records so far that a stage's passes read and write."""
